"""The reduction shard (docs/wire.md, "Shards")."""

from .core import ShardHandle, open_shard, shard_server

__all__ = ["ShardHandle", "open_shard", "shard_server"]
