"""Position-keyed randomness: the uniforms that verification reads for one request, fixed per output position.

A request's stream holds two uniforms in [0, 1) per output position t (0 = the first completion token): column 0
draws the token emitted at t (inverse-CDF sampling), column 1 tests a probabilistic draft at t. Pairs come from
the request's own generator in chunks, in position order, the first time a step reads past those drawn; so pair t
is the same however steps split the positions: with or without drafts, with any K.

With point proposals that makes speculative sampling emit exactly what plain sampling emits from the same seed
(spec/rejection.py). Reading a position again in a later step is sound: the uniforms of positions past a step's
first rejection were read by nothing that step kept (its emitted tokens depend on the positions up to the
rejection only), so when a later step verifies them they are still independent of everything emitted before.
"""

import torch

_CHUNK = 32  # positions drawn at once: one generator call covers most completions' next several steps


class PositionUniforms:
    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self._pairs: list[list[float]] = []  # [position] -> [token uniform, test uniform]

    def take(self, start: int, count: int) -> list[list[float]]:
        """The pairs of positions start .. start + count - 1."""
        end = start + count
        if end > len(self._pairs):
            num_new = max(end - len(self._pairs), _CHUNK)
            self._pairs += torch.rand(num_new, 2, generator=self.generator, device=self.generator.device).tolist()
        return self._pairs[start:end]
