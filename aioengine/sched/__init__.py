"""aioengine.sched: requests, token budgets and KV blocks — pure Python, never imports torch."""
