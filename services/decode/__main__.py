"""python -m services.decode: an engine worker of role decode (flags as python -m services.worker)."""

from services.worker.__main__ import main

if __name__ == "__main__":
    main("decode")
