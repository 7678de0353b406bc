"""One generator, one call at a time: concurrent `generate` calls from several threads wait for each other, so each
gets the whole cache and its own call number (and so its own seed)."""

import threading
import time

from rollout import RolloutGenerator, SamplingParams

PROMPTS = [[5, 6, 7], [9], [3, 4], [10, 11, 12]]


def test_concurrent_calls_are_serialised(target):
    """Two threads call at once on a generator whose cache fits one call's requests: without the lock the second
    call finds no free slot (or both derive the same call seed, from num_calls == 0, and sample alike)."""
    generator = RolloutGenerator(target, max_num_seqs=len(PROMPTS), max_model_len=32)
    forward = generator.backend.runner.forward
    generator.backend.runner.forward = lambda *args: time.sleep(0.002) or forward(*args)  # calls overlap for sure
    start, batches, errors = threading.Barrier(2), [], []

    def call():
        start.wait()
        try:
            batches.append(generator.generate(PROMPTS, 1, SamplingParams(temperature=1.0, max_tokens=8),
                                              use_tqdm=False))
        except Exception as error:  # the main thread asserts there were none
            errors.append(error)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert generator.num_calls == 2
    first, second = ([s.completion_ids for s in batch.samples] for batch in batches)
    assert first != second  # calls 0 and 1: different seeds
