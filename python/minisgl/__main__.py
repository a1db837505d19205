import sys

from minisgl.server.args import parse_args
from minisgl.server.launch import launch_server


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args.model is None:
        from minisgl.models.gguf import DefaultModelMissing, announce_default_model

        try:
            args.model = announce_default_model()
        except DefaultModelMissing as e:
            print(f"python -m minisgl: {e}", file=sys.stderr)
            return 2
    return launch_server(args)


if __name__ == "__main__":
    sys.exit(main())
