"""python -m fairseq_plugin.benchmark: the same as annotated-benchmark."""

from .main import main

if __name__ == "__main__":
    main()
