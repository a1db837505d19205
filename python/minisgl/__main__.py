"""`python -m minisgl`: the OpenAI-compatible server, or with --shell a terminal chat."""

import sys

from minisgl.extension import extensions
from minisgl.models.weight import default_model
from minisgl.server.args import parse_args
from minisgl.server.launch import launch_server, serve_http
from minisgl.shell import run_shell

# every name of --max-running-requests (a test checks them against its aliases); the shell's
# default is one request
BATCH_FLAGS = ("--max-running-requests", "--max-num-seqs")


def main() -> int:
    try:
        args = parse_args(sys.argv[1:])
    except ValueError as e:  # options this machine cannot run
        print(f"minisgl: {e}", file=sys.stderr)
        return 1
    if args.engine.model is None:
        try:
            args.engine.model = default_model()
        except ValueError as e:  # not installed, or no cpu extension to read it
            print(f"python -m minisgl: {e}", file=sys.stderr)
            return 2
        # a short id in /v1/models, not a path inside site-packages (the path is accepted too)
        args.served_model_name = args.served_model_name or extensions().default_model_name
    if args.shell and not any(arg.startswith(BATCH_FLAGS) for arg in sys.argv[1:]):
        args.engine.max_running_requests = 1  # one chat: no batch graphs or batch steps to build
    return launch_server(args, run_shell if args.shell else serve_http)


if __name__ == "__main__":
    sys.exit(main())
