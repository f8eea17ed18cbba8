"""The `ds4tools` command line: a thin layer over the library."""
import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ds4tools")
def main():
    """GGUF quantizer, inspector and numba engine with lossless speculative decoding."""


if __name__ == "__main__":
    main()
