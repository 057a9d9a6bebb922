"""/metrics mirrors the KV tiers' counters of `EngineStats` by their delta since the last step."""

import dataclasses

from pagedkv.engine.client import QueueSizes
from pagedkv.engine.outputs import EngineStats
from pagedkv.server.metrics import ServerMetrics


class _Engine:
    """Just what `update_from_engine` reads."""

    def __init__(self, stats: EngineStats):
        self.stats = stats

    def latest_stats(self) -> EngineStats:
        return self.stats

    def health(self):
        return None

    def queue_sizes(self) -> QueueSizes:
        return QueueSizes(0, 0, 0)


def _stats(**tiers) -> EngineStats:
    zero = {f.name: 0 for f in dataclasses.fields(EngineStats)}
    return EngineStats(**{**zero, "num_blocks": 8, "block_size": 16, **tiers})


def _value(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_tier_counters_move_by_what_the_engine_counted():
    metrics = ServerMetrics()
    engine = _Engine(_stats(kv_host_hit_blocks=5, kv_h2d_bytes=1000, kv_h2d_seconds=0.5))
    metrics.update_from_engine(engine)  # the baseline
    engine.stats = _stats(kv_host_hit_blocks=12, kv_disk_hit_blocks=3, kv_h2d_bytes=4000, kv_h2d_seconds=0.75)
    metrics.update_from_engine(engine)
    text = metrics.render().decode()
    assert _value(text, "pagedkv_kv_host_hit_blocks_total") == 7
    assert _value(text, "pagedkv_kv_disk_hit_blocks_total") == 3
    assert _value(text, "pagedkv_kv_host_to_device_bytes_total") == 3000
    assert _value(text, "pagedkv_kv_host_to_device_seconds_total") == 0.25
