import asyncio
import dataclasses
import threading

import msgpack
import pytest

from minisgl import message as msg_base
from minisgl.core import SamplingParams
from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BatchMsg,
    DetokenizeMsg,
    ExitMsg,
    TokenizeMsg,
    UserMsg,
    UserReply,
    decode,
    encode,
    register,
)
from minisgl.utils.zmq import ZmqAsyncPullQueue, ZmqAsyncPushQueue, ZmqPullQueue, ZmqPushQueue

PARAMS = SamplingParams(
    temperature=0.7, top_k=20, top_p=0.95, min_p=0.05, max_tokens=64, stop_token_ids=[1, 2], seed=7
)
REPLY = UserReply(
    uid=3,
    text_delta="héllo 你好 😀",
    token_ids=[5, 6],
    finished=True,
    finish_reason="stop",
    prompt_tokens=10,
    completion_tokens=2,
    error=None,
)
DETOK = DetokenizeMsg(uid=4, token_ids=[9, 10, 11], finished=False, finish_reason=None)

ALL_MESSAGES = [
    PARAMS,
    SamplingParams(),
    TokenizeMsg(
        uid=1, text="hi", input_ids=None, chat=None, params=SamplingParams(stop=["\n", "END"])
    ),
    TokenizeMsg(uid=2, text=None, input_ids=[1, 2, 3], chat=None, params=SamplingParams()),
    TokenizeMsg(
        uid=2**40,
        text=None,
        input_ids=None,
        chat=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "你好"}],
        params=PARAMS,
        skip_special_tokens=False,
    ),
    AbortMsg(uid=5),
    UserMsg(uid=6, input_ids=list(range(1000)), params=PARAMS),
    AbortBackendMsg(uid=7),
    ExitMsg(),
    BatchMsg(msgs=[UserMsg(uid=8, input_ids=[1], params=PARAMS), AbortBackendMsg(uid=9)]),
    BatchMsg(msgs=[]),
    DETOK,
    BatchMsg(msgs=[DETOK, DetokenizeMsg(1, [], True, "length")]),
    REPLY,
    UserReply(2, "", [], True, "abort", 0, 0, error="prompt too long"),
    BatchMsg(msgs=[REPLY, REPLY]),
]


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    out = decode(encode(msg))
    assert type(out) is type(msg)
    assert out == msg


def test_nested_types_are_rebuilt():
    out = decode(encode(BatchMsg(msgs=[UserMsg(uid=1, input_ids=[2], params=PARAMS)])))
    assert isinstance(out.msgs[0], UserMsg)
    assert isinstance(out.msgs[0].params, SamplingParams)
    assert out.msgs[0].params.seed == 7


@register
@dataclasses.dataclass
class _AnyValue:
    value: object


@pytest.mark.parametrize(
    "value",
    [
        None,
        0,
        -(2**63),
        2**64 - 1,
        1.0 / 3.0,
        float("inf"),
        "",
        "ünïcödé 🚀",
        b"\x00\xffbytes",
        True,
        False,
        [],
        [1, [2, [3]], "x"],
        {},
        {"a": 1, "b": [None, 2.5], "c": {"d": b"e"}},
        {1: "int key", 2: [3]},
        {"__type__": "ExitMsg", "msgs": []},  # dicts that look like messages stay dicts
        [ExitMsg(), {"nested": AbortMsg(1)}],
    ],
)
def test_plain_values_round_trip(value):
    out = decode(encode(_AnyValue(value)))
    assert out == _AnyValue(value)
    assert type(out.value) is type(value)


def test_bool_and_int_stay_distinct():
    out = decode(encode(_AnyValue([True, 1, 0, False, 1.0])))
    assert [type(x) for x in out.value] == [bool, int, int, bool, float]


def test_unknown_type_name_is_value_error():
    @dataclasses.dataclass
    class Ghost:
        x: int

    register(Ghost)
    data = encode(Ghost(1))
    del msg_base._TYPES["Ghost"]
    with pytest.raises(ValueError, match="Ghost"):
        decode(data)


def test_unknown_type_name_in_handcrafted_payload():
    with pytest.raises(ValueError, match="NoSuchMsg"):
        decode(msgpack.packb([msgpack.ExtType(1, b"NoSuchMsg"), 1, 2]))


def test_messages_are_arrays_tagged_with_their_class():
    """A message is [tag, *values] packed in place (no blob packed apart for each), so that a
    step's 200 replies encode at once; a plain list stays a list, first item a class or not."""
    raw = msgpack.unpackb(encode(AbortMsg(uid=5)))
    assert raw == [msgpack.ExtType(1, b"AbortMsg"), 5]
    assert decode(encode([[1, 2], [], ["AbortMsg", 5]])) == [[1, 2], [], ["AbortMsg", 5]]


def test_unregistered_dataclass_cannot_be_encoded():
    @dataclasses.dataclass
    class NotRegistered:
        x: int

    with pytest.raises(TypeError, match="NotRegistered"):
        encode(NotRegistered(1))


def test_register_rejects_non_dataclass_and_duplicate_name():
    class Plain:
        pass

    with pytest.raises(TypeError):
        register(Plain)

    @dataclasses.dataclass
    class UserMsg:  # same name as the real one
        uid: int

    with pytest.raises(ValueError, match="already registered"):
        register(UserMsg)


def test_tokenize_msg_needs_exactly_one_input():
    with pytest.raises(ValueError):
        TokenizeMsg(uid=1, text=None, input_ids=None, chat=None, params=PARAMS)
    with pytest.raises(ValueError):
        TokenizeMsg(uid=1, text="a", input_ids=[1], chat=None, params=PARAMS)


def test_invalid_params_are_rejected_on_decode():
    bad = msgpack.packb([msgpack.ExtType(1, b"SamplingParams"), -1.0])
    with pytest.raises(ValueError, match="temperature"):
        decode(bad)


def test_push_pull_ipc(tmp_path):
    addr = f"ipc://{tmp_path}/q"
    pull = ZmqPullQueue(addr, create=True)
    push = ZmqPushQueue(addr, create=False)
    try:
        assert pull.get_nowait() is None
        assert pull.get(timeout=0.01) is None
        for msg in ALL_MESSAGES:
            push.put(msg)
        got = [pull.get(timeout=5) for _ in ALL_MESSAGES]
        assert got == ALL_MESSAGES
        assert pull.get_nowait() is None
    finally:
        push.close()
        pull.close()


def test_push_pull_ipc_connect_before_bind_and_threads(tmp_path):
    # The pusher may connect before the puller binds (processes start in any order).
    addr = f"ipc://{tmp_path}/q2"
    push = ZmqPushQueue(addr, create=False)
    push.put(AbortMsg(uid=1))
    pull = ZmqPullQueue(addr, create=True)
    try:
        assert pull.get(timeout=5) == AbortMsg(uid=1)

        def producer():
            for i in range(100):
                push.put(DetokenizeMsg(uid=i, token_ids=[i], finished=False, finish_reason=None))

        t = threading.Thread(target=producer)
        t.start()
        got = [pull.get(timeout=5) for _ in range(100)]
        t.join()
        assert [m.uid for m in got] == list(range(100))
    finally:
        push.close()
        pull.close()


def test_async_push_pull_ipc(tmp_path):
    addr = f"ipc://{tmp_path}/aq"

    async def main():
        pull = ZmqAsyncPullQueue(addr, create=True)
        push = ZmqAsyncPushQueue(addr, create=False)
        try:
            for msg in ALL_MESSAGES:
                await push.put(msg)
            got = [await asyncio.wait_for(pull.get(), timeout=5) for _ in ALL_MESSAGES]
            assert got == ALL_MESSAGES
        finally:
            push.close()
            pull.close()

    asyncio.run(main())


def test_sync_push_to_async_pull(tmp_path):
    # The api server pulls asynchronously what the (sync) detokenizer pushes.
    addr = f"ipc://{tmp_path}/mixed"

    async def main():
        pull = ZmqAsyncPullQueue(addr, create=True)
        push = ZmqPushQueue(addr, create=False)
        try:
            push.put(BatchMsg(msgs=[REPLY]))
            got = await asyncio.wait_for(pull.get(), timeout=5)
            assert got == BatchMsg(msgs=[REPLY])
        finally:
            push.close()
            pull.close()

    asyncio.run(main())
