"""trainer.stop_at: a run ends early once the recent mean of each named metric reaches its target (a sweep point
that has learned its task stops paying for its nodes). Rank 0 keeps the window; the loop agrees on the decision."""

from __future__ import annotations

import math
from collections import deque

from .errors import TrainingError


class StopAt:
    """The last `window` values of each metric of trainer.stop_at, and whether all their means reach the targets."""

    def __init__(self, targets: dict[str, float], window: int, history: list[dict] = ()):
        self.targets, self.window = dict(targets), window
        self.values = {name: deque(maxlen=window) for name in self.targets}
        for row in history:  # a resumed run's steps count toward the window
            for name, seen in self.values.items():
                if isinstance(row.get(name), (int, float)):
                    seen.append(float(row[name]))

    def reached(self, metrics: dict) -> str | None:
        """After a step: None, or why the run stops ("reward_mean 0.812 >= 0.8 over the last 5 steps")."""
        for name, seen in self.values.items():
            value = metrics.get(name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                logged = ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, (int, float))))
                raise TrainingError(f"trainer.stop_at: this run does not log the metric {name!r}; name one it logs "
                                    f"({logged})")
            if math.isfinite(value):
                seen.append(float(value))
        if not self.targets or any(len(seen) < self.window for seen in self.values.values()):
            return None
        means = {name: sum(seen) / len(seen) for name, seen in self.values.items()}
        if all(means[name] >= target for name, target in self.targets.items()):
            return ", ".join(f"{name} {means[name]:.3f} >= {self.targets[name]:g}" for name in self.targets) + \
                f" over the last {self.window} steps"
        return None
