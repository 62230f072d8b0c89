"""A step's predicted duration, fitted online to measured steps: what the ITL-aware token budget spends.

duration = a + b * decode_rows + c * prefill_tokens + d * decode_context + e * prefill_attention
- decode_rows: requests decoding (one token each, or 1 + k verified drafts);
- prefill_tokens: prompt tokens in the step's chunks;
- decode_context: KV tokens the decode rows read (their sequence lengths);
- prefill_attention: sum over chunks of tokens x (context + tokens): attention's work grows with both.

Recursive least squares with a forgetting factor: each measured step updates the fit in O(5^2) pure
Python (sched never imports numpy), and old steps fade, so the fit follows a machine whose speed changes.
A target is a bound on gaps, whose tail is what a user sees: the model also keeps its recent errors, and
chunks are planned so that a step stays within the target at their 90th percentile, not only on average.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

NUM_FEATURES = 5  # the constant, then the four counts above


@dataclass(slots=True)
class StepFeatures:
    """What a planned step holds, in the model's terms (SchedulerOutput carries it to the step's result)."""

    decode_rows: int = 0
    prefill_tokens: int = 0
    decode_context: int = 0
    prefill_attention: int = 0

    def vector(self) -> list[float]:
        return [
            1.0,
            float(self.decode_rows),
            float(self.prefill_tokens),
            float(self.decode_context),
            float(self.prefill_attention),
        ]

    def add_prefill(self, tokens: int, context: int) -> None:
        """A chunk of ``tokens`` prompt tokens after ``context`` computed ones."""
        self.prefill_tokens += tokens
        self.prefill_attention += tokens * (context + tokens)


@dataclass(slots=True)
class StepCostModel:
    """Online fit of step durations (seconds) to StepFeatures."""

    forgetting: float = 0.995  # an observation's weight halves after ~140 steps
    prior: float = 1e3  # initial covariance scale: the first steps move the fit freely
    min_observations: int = 16  # predictions before this many steps are None (no cap yet)
    error_quantile: float = 0.9  # of measured / predicted over the last error_window steps: the margin
    error_window: int = 64
    theta: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    observations: int = 0
    margin: float = 1.0  # a step's planned duration times this stays within a limit (>= 1)
    _errors: deque[float] = field(init=False)
    _p: list[list[float]] = field(init=False)
    _scale: list[float] = field(default_factory=lambda: [1.0, 1e-2, 1e-3, 1e-5, 1e-7])

    def __post_init__(self) -> None:
        # Features differ by orders of magnitude (1 vs thousands of tokens vs millions of context): the fit
        # runs on scaled features, so one prior suits all.
        self._p = [[self.prior if i == j else 0.0 for j in range(NUM_FEATURES)] for i in range(NUM_FEATURES)]
        self._errors = deque(maxlen=self.error_window)

    def _x(self, f: StepFeatures) -> list[float]:
        return [v * s for v, s in zip(f.vector(), self._scale, strict=True)]

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """One measured step."""
        if not seconds > 0:
            return
        x, p, lam = self._x(features), self._p, self.forgetting
        px = [sum(p[i][j] * x[j] for j in range(NUM_FEATURES)) for i in range(NUM_FEATURES)]
        denom = lam + sum(x[i] * px[i] for i in range(NUM_FEATURES))
        gain = [v / denom for v in px]
        predicted = sum(t * v for t, v in zip(self.theta, x, strict=True))
        if self.observations >= self.min_observations and predicted > 0:
            # the error the planner faced (the fit before this step): the margin follows the machine's noise
            self._errors.append(seconds / predicted)
            if len(self._errors) >= self.min_observations:
                ordered = sorted(self._errors)
                self.margin = max(1.0, ordered[int(self.error_quantile * (len(ordered) - 1))])
        err = seconds - predicted
        self.theta = [t + g * err for t, g in zip(self.theta, gain, strict=True)]
        self._p = [
            [(p[i][j] - gain[i] * px[j]) / lam for j in range(NUM_FEATURES)] for i in range(NUM_FEATURES)
        ]
        self.observations += 1

    def coefficients(self) -> list[float]:
        """(a, b, c, d, e) in seconds per unit of each feature."""
        return [t * s for t, s in zip(self.theta, self._scale, strict=True)]

    def predict(self, features: StepFeatures) -> float | None:
        """Predicted seconds, or None until the fit has seen ``min_observations`` steps."""
        if self.observations < self.min_observations:
            return None
        return sum(t * v for t, v in zip(self.theta, self._x(features), strict=True))

    def max_prefill(self, base: StepFeatures, context: int, seconds: float) -> int | None:
        """The most prompt tokens a chunk after ``context`` computed ones may add to a step holding ``base``
        and stay within ``seconds`` (its prediction times the margin); None without a fit (no cap). 0 when
        the base alone is at the limit, or when no slope yet prices a prompt token (the floor then)."""
        if self.observations < self.min_observations:
            return None
        _, b, c, _, e = self.coefficients()
        c, e = max(c, 0.0), max(e, 0.0)  # a noisy fit's negative slope would lift the cap without bound
        if c == 0.0 and e == 0.0:
            # No evidence yet of what a prompt token costs (a fit of decodes and a short prompt or two): it
            # goes through the same linears as a decode row, so it is taken to cost as much.
            c = max(b, 0.0)
        # A fit on few or alike steps can slope below zero (a decode row that takes time off): a step with
        # decodes never takes less than nothing, or the time it "frees" would go to prompt tokens.
        left = seconds / self.margin - max(self.predict(base) or 0.0, 0.0)
        if left <= 0 or (c == 0.0 and e == 0.0):
            return 0  # the decodes fill the limit, or no slope says what a prompt token costs: the floor only
        # e n^2 + (c + e context) n <= left
        lin = c + e * context
        if e == 0.0:
            return int(left / lin)
        disc = lin * lin + 4.0 * e * left
        return int((-lin + disc**0.5) / (2.0 * e))


class PrefillCap:
    """One step's prompt chunks under the ITL target: each chunk gets what the step's predicted time has left,
    in whole blocks; the step's first chunk gets at least one block, so prompts always make progress. A step
    with no decode has no inter-token gap to keep short: its chunks take the token budget alone.

    The step's limit is ``seconds``, or ``ratio`` times the predicted duration of its decodes alone where that
    is longer: a relative limit keeps a gap near the usual one however fast the machine is at the moment, and
    however many streams share the step (at a high concurrency the decodes alone outlast any fixed target)."""

    __slots__ = ("block_size", "cut", "model", "seconds", "started", "step")

    def __init__(
        self, model: StepCostModel | None, seconds: float, ratio: float, block_size: int, step: StepFeatures
    ) -> None:
        self.model = model  # None: no target, no cut
        if model is not None and ratio > 0 and step.decode_rows:
            decodes = model.predict(step)  # before any chunk is planned: the decodes alone
            if decodes is not None:
                seconds = max(seconds, ratio * decodes)
        self.seconds = seconds
        self.block_size = block_size
        self.step = step
        self.started = False  # a chunk is already planned in this step
        self.cut = 0  # 1 once a chunk was cut short by the target

    def limit(self, need: int, context: int) -> int:
        if self.model is None or self.step.decode_rows == 0:
            return need  # no target, or no stream waits on this step: the token budget alone
        cap = self.model.max_prefill(self.step, context, self.seconds)
        if cap is None or cap >= need:
            return need
        cap -= cap % self.block_size  # whole blocks: the prefix cache keeps full blocks
        if not self.started:
            cap = max(cap, self.block_size)  # progress: one block a step, whatever the prediction
        self.cut = 1
        return min(cap, need)

    def planned(self, tokens: int, context: int) -> None:
        self.started = True
        if self.model is not None:
            self.step.add_prefill(tokens, context)
