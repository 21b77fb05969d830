"""python -m services.prefill: an engine worker of role prefill (flags as python -m services.worker)."""

from services.worker.__main__ import main

if __name__ == "__main__":
    main("prefill")
