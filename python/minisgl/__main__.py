import sys

from minisgl.server.args import parse_args
from minisgl.server.launch import launch_server


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args.model is None:
        print(
            "python -m minisgl: error: argument --model: required (a local directory or a hub id)",
            file=sys.stderr,
        )
        return 2
    return launch_server(args)


if __name__ == "__main__":
    sys.exit(main())
