"""Incremental JSON: a strict validator fed one character at a time, and the parser of one tool
call object (`{"name": ..., "arguments": ...}`) built on it.

Streaming needs to know, at every character, whether the text so far can still become valid
JSON, where a value ends, and which characters belong to the arguments value, so that argument
fragments go out as they arrive and their concatenation is exactly the arguments' raw text.
"""

from __future__ import annotations

import json
from enum import Enum

WHITESPACE = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class Scan(Enum):
    MORE = 0  # the character belongs to the value, which goes on
    DONE = 1  # the character belongs to the value and closes it
    END = 2  # the value (a number) ended just before this character, which is not consumed
    ERROR = 3  # no valid JSON value continues this way; the character is not consumed


# expectations between tokens
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)
# number states; the terminal ones may end the number
_N_SIGN, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_E_SIGN, _N_EXP = range(8)
_N_TERMINAL = (_N_ZERO, _N_INT, _N_FRAC, _N_EXP)


def _number_step(state: int, ch: str) -> int | None:
    """The number state after `ch`, or None when `ch` cannot continue the number."""
    digit = "0" <= ch <= "9"
    if state == _N_SIGN:
        return _N_ZERO if ch == "0" else _N_INT if digit else None
    if state in (_N_ZERO, _N_INT) and ch == ".":
        return _N_DOT
    if state in (_N_ZERO, _N_INT, _N_FRAC) and ch in "eE":
        return _N_E
    if state == _N_E and ch in "+-":
        return _N_E_SIGN
    if digit and state != _N_ZERO:
        return {_N_INT: _N_INT, _N_DOT: _N_FRAC, _N_FRAC: _N_FRAC}.get(state, _N_EXP)
    return None


class JsonScanner:
    """Validates one JSON value (RFC 8259, no leading whitespace) character by character."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers, "{" or "["
        self.expect = _VALUE
        self.token: str | None = None  # "string", "number", "literal" while inside one
        self.escape = -1  # in a string: -1 none, 0 after "\", 1..4 hex digits of \uXXXX seen
        self.number = _N_SIGN
        self.literal = ""  # the rest of true / false / null still expected
        self.done = False

    def complete(self) -> bool:
        """Whether the text fed so far is a whole value (a top-level number may end here)."""
        if self.done:
            return True
        return not self.stack and self.token == "number" and self.number in _N_TERMINAL

    def feed(self, ch: str) -> Scan:
        if self.done:
            return Scan.ERROR
        if self.token == "string":
            return self._string(ch)
        if self.token == "literal":
            if ch != self.literal[0]:
                return Scan.ERROR
            self.literal = self.literal[1:]
            return Scan.MORE if self.literal else self._value_ended()
        if self.token == "number":
            state = _number_step(self.number, ch)
            if state is not None:
                self.number = state
                return Scan.MORE
            if self.number not in _N_TERMINAL:
                return Scan.ERROR
            if self._value_ended() == Scan.DONE:
                return Scan.END  # a top-level number: `ch` is not part of it
            return self.feed(ch)  # `ch` follows the number inside its container
        return self._between(ch)

    def _string(self, ch: str) -> Scan:
        if self.escape == 0:
            if ch not in _ESCAPES and ch != "u":
                return Scan.ERROR
            self.escape = 1 if ch == "u" else -1
        elif self.escape > 0:
            if ch not in _HEX:
                return Scan.ERROR
            self.escape = -1 if self.escape == 4 else self.escape + 1
        elif ch == "\\":
            self.escape = 0
        elif ch == '"':
            self.token = None
            if self.expect == _KEY:
                self.expect = _COLON
                return Scan.MORE
            return self._value_ended()
        elif ch < " ":
            return Scan.ERROR  # control characters must be escaped
        return Scan.MORE

    def _between(self, ch: str) -> Scan:
        if ch in WHITESPACE:
            return Scan.MORE if self.stack else Scan.ERROR
        expect = self.expect
        if expect in (_KEY, _KEY_OR_CLOSE) and ch == '"':
            self.expect, self.token = _KEY, "string"
            return Scan.MORE
        if expect == _COLON and ch == ":":
            self.expect = _VALUE
            return Scan.MORE
        if expect == _COMMA_OR_CLOSE and ch == ",":
            self.expect = _KEY if self.stack[-1] == "{" else _VALUE
            return Scan.MORE
        closer = {"{": "}", "[": "]"}.get(self.stack[-1]) if self.stack else None
        if expect in (_KEY_OR_CLOSE, _VALUE_OR_CLOSE, _COMMA_OR_CLOSE) and ch == closer:
            self.stack.pop()
            return self._value_ended()
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            return self._value_start(ch)
        return Scan.ERROR

    def _value_start(self, ch: str) -> Scan:
        if ch in "{[":
            self.stack.append(ch)
            self.expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
        elif ch == '"':
            self.token = "string"
        elif ch == "-" or "0" <= ch <= "9":
            self.token = "number"
            self.number = _N_SIGN if ch == "-" else _N_ZERO if ch == "0" else _N_INT
        elif ch in _LITERALS:
            self.token, self.literal = "literal", _LITERALS[ch][1:]
        else:
            return Scan.ERROR
        return Scan.MORE

    def _value_ended(self) -> Scan:
        self.token = None
        if self.stack:
            self.expect = _COMMA_OR_CLOSE
            return Scan.MORE
        self.done = True
        return Scan.DONE


NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama's prompts say "parameters", Qwen's "arguments"

# where a call object's parser stands
_OPEN, _MEMBER_KEY, _MEMBER_COLON, _MEMBER_VALUE, _AFTER_MEMBER, _CLOSED = range(6)


class CallObject:
    """Parses one `{"name": "f", "arguments": {...}}` object (members in any order, other
    members ignored; "parameters" is read as "arguments") character by character.
    `arguments` grows with the raw text of the arguments value as it arrives; `name` is set once
    the name's string is complete."""

    def __init__(self) -> None:
        self.state = _OPEN
        self.scanner = JsonScanner()
        self.raw = ""  # the key or value being read
        self.key = ""
        self.seen: set[str] = set()
        self.name: str | None = None
        self.arguments = ""
        self.has_arguments = False
        self.expect_key = True  # between members: a key is due (after "{" or ",")
        self.value_started = False  # whitespace before a member's value is not part of it

    def feed(self, ch: str) -> Scan:
        """MORE, DONE (the closing brace), or ERROR (`ch` not consumed)."""
        state = self.state
        if state in (_MEMBER_KEY, _MEMBER_VALUE):
            return self._in_token(ch)
        if ch in WHITESPACE and state != _OPEN:
            return Scan.MORE
        if state == _OPEN:
            if ch != "{":
                return Scan.ERROR
            self.state, self.expect_key = _AFTER_MEMBER, True
            return Scan.MORE
        if state == _MEMBER_COLON:
            if ch != ":":
                return Scan.ERROR
            self.state, self.raw, self.scanner = _MEMBER_VALUE, "", JsonScanner()
            self.value_started = False
            return Scan.MORE
        return self._after_member(ch)

    def _after_member(self, ch: str) -> Scan:
        """Between members: a key (after "{" or ","), a comma or the closing brace."""
        if ch == "}" and (not self.expect_key or not self.seen):
            if self.name is None:
                return Scan.ERROR  # a call needs a name
            self.state = _CLOSED
            return Scan.DONE
        if self.expect_key and ch == '"':
            self.state, self.raw, self.scanner = _MEMBER_KEY, "", JsonScanner()
            return self._in_token(ch)
        if not self.expect_key and ch == ",":
            self.expect_key = True
            return Scan.MORE
        return Scan.ERROR

    def _in_token(self, ch: str) -> Scan:
        if self.state == _MEMBER_VALUE and not self.value_started:
            if ch in WHITESPACE:
                return Scan.MORE
            self.value_started = True
        result = self.scanner.feed(ch)
        if result == Scan.ERROR:
            return Scan.ERROR
        if result == Scan.END:  # a number value ended: `ch` comes after the member
            return self._member_done(ch)
        self.raw += ch
        if self.state == _MEMBER_VALUE and self.key in ARGUMENT_KEYS:
            self.arguments += ch
        if result == Scan.DONE:
            return self._member_done(None)
        return Scan.MORE

    def _member_done(self, following: str | None) -> Scan:
        if self.state == _MEMBER_KEY:
            self.key = json.loads(self.raw)
            if self.key in self.seen or (self.key in ARGUMENT_KEYS and self.has_arguments):
                return Scan.ERROR  # a repeated member makes the call ambiguous
            self.seen.add(self.key)
            self.has_arguments |= self.key in ARGUMENT_KEYS
            self.state = _MEMBER_COLON
            return Scan.MORE
        if self.key == NAME_KEY:
            name = json.loads(self.raw)
            if not isinstance(name, str) or not name:
                return Scan.ERROR
            self.name = name
        self.state, self.expect_key = _AFTER_MEMBER, False
        return self.feed(following) if following is not None else Scan.MORE

    @property
    def closed(self) -> bool:
        return self.state == _CLOSED
