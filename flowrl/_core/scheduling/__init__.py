"""Who runs what next: the splitter policies and a call's fitted cost, the length memory, the
per-stage queues, deterministic mode's fixed shards, the pull scheduler, the busy clock of
overlapping calls and the autoscaling policy."""
