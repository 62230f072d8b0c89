"""The CPU backend: its worker thread, packed linears, the one-call decode stack, huge pages, int4/int8."""
