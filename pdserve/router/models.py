"""The models a router serves, and each one's share of the worker pool.

One router fronts every model of a cluster. Workers of all models sit in one ``WorkerPool`` (the
state store lists them all; the prefix index is keyed by worker, so one index serves every model);
each model sees only its own through ``ModelWorkers``, which keeps a worker whose ``Info`` names that
model (``WorkerConfig.served_model_name``). A request's ``model`` picks the model by its name or an
alias; its dispatcher chooses among that model's workers alone, so KV never crosses models (the
transfer's fingerprint check would refuse it anyway).

A one-model router (``name`` empty) keeps every worker and is called by the name its workers
report, as before several models could be served.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from pdserve.engine.tokenizer import ModelTokenizer
from pdserve.proto.v1 import worker_pb2 as pb
from pdserve.router.pool import WorkerHandle, WorkerPool, model_info


@dataclass(frozen=True)
class ServedModel:
    """A model as clients name it: ``name`` (empty: a one-model router, named by its workers),
    ``aliases``, the spec its tokenizer and workers load, and the tokenizer."""

    spec: str
    tokenizer: ModelTokenizer
    name: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)


class ModelWorkers:
    """The workers of one model in a shared pool: what a Dispatcher needs of a pool, filtered."""

    def __init__(self, pool: WorkerPool, model: str = ""):
        self.pool = pool
        self.model = model  # "" keeps every worker (a one-model router)

    def _ours(self, w: WorkerHandle) -> bool:
        return not self.model or (w.info is not None and w.info.model == self.model)

    @property
    def workers(self) -> list[WorkerHandle]:
        return [w for w in self.pool.workers if self._ours(w)]

    @property
    def changed(self):
        return self.pool.changed

    def healthy(self, role: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.pool.healthy(role) if self._ours(w)]

    def by_id(self, worker_id: str) -> WorkerHandle:
        return self.pool.by_id(worker_id)

    def mark_down(self, w: WorkerHandle, reason: str) -> None:
        self.pool.mark_down(w, reason)

    async def wait_for(self, role: str, timeout_s: float, exclude: Collection[str] = ()) -> bool:
        # WorkerPool's wait, over this model's workers (it reads only healthy() and changed)
        return await WorkerPool.wait_for(self, role, timeout_s, exclude)  # type: ignore[arg-type]

    def model_info(self) -> pb.WorkerInfo | None:
        return model_info(self.workers)

    def contention(self) -> dict[str, frozenset[str]]:
        return self.pool.contention()  # every model's workers compete for the same compute
