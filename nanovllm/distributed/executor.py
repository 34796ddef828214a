"""The executors an engine runs its steps on (nanovllm.engine.executor.Executor): with one rank, the
ModelRunner in this process; with tensor_parallel_size=N > 1, rank 0's ModelRunner here and ranks
1..N-1 in worker processes (worker.py), each step sent to them before rank 0 runs its own share."""

from nanovllm.config import Config
from nanovllm.distributed.worker import TPWorkers
from nanovllm.engine.executor import Executor, PendingStep
from nanovllm.engine.step import SamplingBatch, StepBatch, StepOutput
from nanovllm.runner.model_runner import ModelRunner


class TPExecutor:
    def __init__(self, config: Config) -> None:
        self.world_size = config.tensor_parallel_size
        # Ranks 1..N-1 start loading in their own processes while rank 0 loads here.
        self.workers = TPWorkers(config)
        self.runner: ModelRunner | None = None
        try:
            with self.workers.scope():
                self.runner = ModelRunner(config)
        except BaseException:
            self.shutdown()  # no worker outlives a failed constructor
            raise
        self.info = self.runner.info

    @property
    def worker_pids(self) -> list[int]:
        """What a parent must clean up if this process is killed (nanovllm.dp.replica)."""
        return [process.pid for process in self.workers.processes]

    @property
    def shm_names(self) -> list[str]:
        name = self.workers.channel_name
        return [] if name is None else [name]

    def run(self, batch: StepBatch) -> StepOutput:
        return self.workers.run(self.runner, batch)

    def launch(self, batch: StepBatch, previous: PendingStep | None, defer_sampling: bool = False
               ) -> PendingStep:
        raise NotImplementedError("overlap scheduling runs on a single rank (Config.async_scheduling)")

    def check_sampling(self, sampling: SamplingBatch) -> None:
        self.runner.check_sampling(sampling)

    def shutdown(self) -> None:
        self.workers.shutdown()
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.shutdown()


def make_executor(config: Config) -> Executor:
    """The executor for `config`'s tensor_parallel_size (nanovllm.engine.llm_engine calls it)."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    return TPExecutor(config)
