"""Pipeline parallelism: layer partitioning, p2p communication, schedule tables and executor."""
