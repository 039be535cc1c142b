"""The training modes, each in one place: its engine part, its settings' checks and its Lightning part.

| mode      | what it is                                              | engine (no Lightning) | Lightning layer                 |
|-----------|---------------------------------------------------------|-----------------------|---------------------------------|
| flush     | one weight version (every synchronous schedule)         | `Flush`               | `FlushLayer`                    |
| two_bw    | PipeDream-2BW: two weight versions, 1-stale updates     | `DoubleBuffer`        | `DoubleBufferLayer`             |
| width     | replicas of one pipeline (data parallel), or none       | (REDUCE's all-reduce) | `AllReduce`, `NoReplicas`       |
| avgpipe   | AvgPipe: N pipelines, elastic averaging                 | `ElasticAveraging`    | `ElasticReplicas`               |
| advance   | AvgPipe's advance forward, Algorithm 1                  | `AdvanceRule`         | `AdvanceController`             |
| partition | a static cut, or AutoPipe-RL's adaptive re-partitioning | `lightning_pipe.adaptive` | `StaticPartition`, `AdaptivePartition` |

In every mode's folder: `engine.py` runs without Lightning; `settings.py` checks the mode's settings
(`check_config`, called by `PipelineConfig`) and the Trainer settings it cannot honour
(`check_trainer`), also without Lightning; `lightning.py` is its layer, behind the interfaces of
`modes/lightning.py` (and the engine's of `modes/engine.py`). `lightning/compose.py` turns a config
into layers and calls their hooks; which settings combine is `config.py`'s legality table.
"""
