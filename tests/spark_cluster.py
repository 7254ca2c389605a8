"""A Spark standalone cluster for the tests (not a test module): a master and workers started
from the pyspark package, on the loopback interface only.

The pip package has no ``sbin/`` scripts, so each daemon is started the way they start it,
``bin/spark-class org.apache.spark.deploy.master.Master`` and ``...worker.Worker``, each in a
process group of its own (a worker's executors are its children). Every daemon binds
127.0.0.1 (``--host`` and ``SPARK_LOCAL_IP``, which the web UIs and the executors' block
managers bind too) and picks free ports itself (port 0); the master's port is read from its
log line, so sessions started side by side never race for a port picked in advance.

Their logs, work folders and executors' scratch stay in the folder given (a pytest temporary
folder). Used by ``conftest.spark_master`` when ``DQ_SPARK_CLUSTER=1`` (``make test-cluster``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_MASTER_LINE = re.compile(r"Starting Spark master at (spark://127\.0\.0\.1:\d+)")
_REGISTERED = "Successfully registered with master"
START_TIMEOUT_S = 120


def spark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


class _Daemon:
    """One daemon JVM; its log (standard error) is copied to ``log`` and scanned for lines."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.proc = subprocess.Popen(
            [os.path.join(spark_home(), "bin", "spark-class"), *args], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        threading.Thread(target=self._read, name=f"{name}-log", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        with open(self.log, "w") as out:
            for line in self.proc.stderr:  # read on, so the daemon never blocks on the pipe
                out.write(line)
                out.flush()
                with self.changed:
                    self.lines.append(line)
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, pattern: re.Pattern[str] | str, deadline: float) -> re.Match[str] | str:
        """The first log line matching ``pattern`` (a regex, or a substring)."""
        seen = 0
        with self.changed:
            while True:
                for line in self.lines[seen:]:
                    if isinstance(pattern, str):
                        if pattern in line:
                            return line
                    else:
                        match = pattern.search(line)
                        if match:
                            return match
                seen = len(self.lines)
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the Spark {self.name} exited with status "
                                       f"{self.proc.returncode} before it was ready; its log: "
                                       f"{self.log}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the Spark {self.name} was not ready within "
                                       f"{START_TIMEOUT_S} s; its log: {self.log}")
                self.changed.wait(min(left, 1.0))

    def stop(self) -> None:
        """SIGTERM the daemon's process group (a worker's shutdown kills its executors, which
        are in its group too), then SIGKILL what is left after 20 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # executors left behind, if any
        self.proc.wait()


@contextlib.contextmanager
def standalone_cluster(workdir: Path, *, workers: int = 2, cores: int = 1,
                       memory: str = "1g") -> Iterator[str]:
    """Start a master and ``workers`` workers (``cores`` cores and ``memory`` each); yields
    the master's URL (``spark://127.0.0.1:PORT``) once every worker registered with it, and
    stops them all when the block ends. Logs are in ``workdir``."""
    env = {**os.environ, "SPARK_HOME": spark_home(), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_LOG_DIR": str(workdir), "SPARK_WORKER_DIR": str(workdir / "work"),
           # executors' scratch (shuffle, blocks) in workdir, not in /tmp
           "SPARK_LOCAL_DIRS": str(workdir / "local")}
    deadline = time.monotonic() + START_TIMEOUT_S
    daemons: list[_Daemon] = []
    try:
        master = _Daemon("master", ["org.apache.spark.deploy.master.Master", "--host",
                                    "127.0.0.1", "--port", "0", "--webui-port", "0"],
                         workdir / "master.log", env)
        daemons.append(master)
        found = master.wait_for(_MASTER_LINE, deadline)
        assert isinstance(found, re.Match)
        url = found.group(1)
        for i in range(workers):
            daemons.append(_Daemon(
                f"worker {i + 1}",
                ["org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                 "--port", "0", "--webui-port", "0", "--cores", str(cores), "--memory", memory,
                 "--work-dir", str(workdir / f"work-{i + 1}")],
                workdir / f"worker-{i + 1}.log", env))
        for worker in daemons[1:]:
            worker.wait_for(_REGISTERED, deadline)
        yield url
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
