"""Local data parallelism (``aioengine serve --data-parallel-size N``): a front process that routes HTTP
requests over N engine processes. router.py picks a replica, replicas.py runs them, proxy.py serves."""
