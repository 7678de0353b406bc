"""The rollout history of a pool of servers (rollout/history.py's ServerHistory): each prompt's rollouts live on the
server its group runs on (server_backend.route), so every operation sends each server its own prompts' share.

`add` groups the rollouts by server; `save` has every server write its history into its history_dir and merges the
parts into one file (the folders must be readable here); `load` checks the file, splits it by server and has each
server load its own part only. The parts travel through the servers' history_dir folders (server.history_file).
"""

import os

from rollout.server_backend.client import Server
from rollout.vllm_backend import wire
from spec.proposers.history import HistoryStore


class ServerHistory:
    """servers: the pool, in routing order; route(prompt_ids, num_servers): a prompt's server; max_rollouts_per_prompt
    and max_tokens: the config's bounds; vocab_size: the target's (None where its folder is not here)."""

    def __init__(self, servers: list[Server], route, max_rollouts_per_prompt: int, max_tokens: int,
                 vocab_size: int | None):
        self.servers, self.route, self.vocab_size = servers, route, vocab_size
        self.bounds = (max_rollouts_per_prompt, max_tokens)

    def add(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        shares: dict[int, list[int]] = {}
        for k, prompt in enumerate(prompt_ids):
            shares.setdefault(self.route(prompt, len(self.servers)), []).append(k)
        for i, ks in shares.items():
            self.servers[i].rpc(wire.ADD_HISTORY, {"prompt_ids": [prompt_ids[k] for k in ks],
                                                   "completion_ids": [completion_ids[k] for k in ks]},
                                f"add {len(ks)} rollouts to the history")

    def save(self, path) -> None:
        merged = HistoryStore(*self.bounds)
        for server in self.servers:
            part = server.history_file()
            server.rpc(wire.SAVE_HISTORY, {"path": part}, f"save the rollout history to {part}")
            merged.update(self._read(part))
        merged.save(path)

    def load(self, path) -> None:
        whole = HistoryStore(*self.bounds)
        whole.load(path, vocab_size=self.vocab_size)  # every server's history unchanged where the file is refused
        for i, server in enumerate(self.servers):
            part = server.history_file()
            whole.subset(lambda prompt: self.route(prompt, len(self.servers)) == i).save(part)
            try:
                server.rpc(wire.LOAD_HISTORY, {"path": part}, f"load the rollout history from {part}")
            finally:
                os.remove(part)

    def _read(self, path: str) -> HistoryStore:
        """The history at `path` (a server's part, removed once read)."""
        store = HistoryStore(*self.bounds)
        try:
            store.load(path)
        finally:
            os.remove(path)
        return store
