"""Storage tiers: where the agent persists snapshots (local NVMe, parallel FS, S3, and any
other fsspec filesystem).

Tier modules load on first use, so importing this package never imports s3fs or fsspec.
"""

from __future__ import annotations

from .base import RetryPolicy, Scope, Tier, TierSpec
from .registry import open_tier, parse_spec, register_tier

__all__ = ["RetryPolicy", "Scope", "Tier", "TierSpec", "open_tier", "parse_spec", "register_tier"]
