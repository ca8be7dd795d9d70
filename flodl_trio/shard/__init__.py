"""The reduction shard: the lanes of a round that the controller places elsewhere."""

from .core import ShardHandle, lane_owner, open_shard

__all__ = ["ShardHandle", "lane_owner", "open_shard"]
