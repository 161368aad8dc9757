"""Shared fixtures: one Ray session per test process (started on first use), and one logbus cluster that
the modules it runs share (see ``bus``).

tests/storage and tests/protocol never request these, so they run without Ray.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
import warnings

import pytest

# Every test connects to Ray explicitly (fixtures). A background thread left behind by a failed
# test (a producer's sender, a group heartbeat) must not silently re-attach this process to a
# Ray cluster that is being torn down: Ray ends a process whose cluster vanishes under it, which
# would cut the run short without a report.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
# Ray's processes report metrics every 10 s by default, and the suite's Ray sessions keep that: at 1 s,
# every worker's exporter and each node's metrics agent took a third of an idle session's CPU
# (perf/RESULTS.md). Tests that read the Prometheus endpoint wait for their values with deadlines
# that allow for it; the modules whose tests hinge on the interval itself (a gauge still there after
# two intervals) start their Ray with this setting (``metrics_every_second``).
METRICS_EVERY_SECOND = {"RAY_metrics_report_interval_ms": "1000"}
# The test hooks that break an invariant on purpose (logbus/invariant.py: require_test_hooks) are
# refused in a process started without this; every Ray process the tests start inherits it, so a
# replica actor accepts them in tests, and only there.
os.environ["LOGBUS_TEST_HOOKS"] = "1"

RAY_INIT_ARGS = dict(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="logbus-tests")


def _lighter_ray_nodes() -> None:
    """Make the Ray nodes this process starts serve their dashboard agent on a free port, and run no log monitor.

    Ray's dashboard agent listens on port 52365 unless told otherwise, and ``ray.init`` cannot tell
    it. A second Ray on the machine finds the port taken and retries it for about 3 s before going
    on without it: every test that runs logbus in a process of its own, as users do (the console
    command, the examples, two processes over one data directory), paid that while the suite's Ray
    held the port. Nodes this process starts take a free port instead (as ``Cluster`` gives its
    worker nodes), leaving 52365 to those processes.

    Ray's log monitor copies its workers' output to the drivers that ask for it (``log_to_driver``),
    and rescans the session's log directory every 0.1 s to do so. The tests' drivers do not ask, and
    their sessions gather the logs of a thousand worker processes in a run: the monitors took about
    7 % of one core for nothing. Worker output still goes to the session's log files.
    """
    from ray._private import node, ray_constants

    start = node.Node.__init__
    if getattr(start, "lighter", False):
        return

    def init(self, ray_params, *args, **kwargs):
        if ray_params.dashboard_agent_listen_port == ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT:
            ray_params.dashboard_agent_listen_port = None  # Node then asks for port 0: any free one
        ray_params.include_log_monitor = False
        start(self, ray_params, *args, **kwargs)

    init.lighter = True
    node.Node.__init__ = init


_lighter_ray_nodes()


def pytest_runtest_logreport(report):
    """Print a failure's report as soon as it happens (as well as in the summary at the end)."""
    if report.failed:
        print(f"\n{report.nodeid} {report.when} FAILED:\n{report.longreprtext}\n", file=sys.__stderr__, flush=True)


def start_ray():
    import ray

    if not ray.is_initialized():
        ray.init(**RAY_INIT_ARGS)


def wait_for(condition, timeout_s: float = 60.0, interval_s: float = 0.05, message: str = "condition"):
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message}")
        time.sleep(interval_s)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    start_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def metrics_every_second(ray_session):
    """For a module whose tests hinge on Ray's metrics report interval: this worker's Ray session is
    started again with a 1 s interval (``METRICS_EVERY_SECOND``, in the environment every process of the
    session inherits), and ended after the module, so that the next module starts the usual one. Such a
    module replaces Ray: it is listed in ``REPLACES_RAY``."""
    ray_session.shutdown()
    os.environ.update(METRICS_EVERY_SECOND)
    try:
        start_ray()
        yield
    finally:
        ray_session.shutdown()
        for name in METRICS_EVERY_SECOND:
            os.environ.pop(name, None)


def close_bus(bus) -> None:
    """Delete the bus's topics and stop its controller, so actors do not pile up across tests."""
    import ray

    from logbus.actors.controller import CONTROLLER_NAME

    try:
        ray.get(bus.controller.destroy.remote(), timeout=120)
    except Exception:  # noqa: BLE001 (best-effort cleanup after a failed test)
        pass
    try:
        ray.kill(ray.get_actor(CONTROLLER_NAME, namespace=bus.namespace), no_restart=True)
    except ValueError:
        pass


@pytest.fixture
def data_dir(tmp_path):
    path = tmp_path / "data"
    path.mkdir()
    return str(path)


def own_bus(data_dir: str):
    """Connect a logbus cluster of its own (namespace and data directory)."""
    import logbus

    start_ray()  # a test may have restarted Ray
    return logbus.connect(data_dir=data_dir, namespace=f"t-{uuid.uuid4().hex[:10]}")


def kafka_python_consumer(topics, **config):
    """A kafka-python KafkaConsumer subscribed to ``topics``, which knows their partitions before its group's first join.

    kafka-python 3.0.12 can lose a rejoin its own metadata starts. A member whose first assignment was made before it
    knew a topic's partitions rejoins when they arrive; if a poll's time runs out while that join is in flight and
    the member (as leader) has already assigned, the next polls no longer see a rejoin to wait for, and the
    assignment is never taken: the member reads nothing, stops heartbeating, and is dropped by its coordinator,
    whatever the broker. Learning the partitions first (as ``partitions_for_topic`` does) leaves no such rejoin.
    """
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(**config)
    consumer.subscribe(topics=list(topics))
    for topic in topics:
        consumer.partitions_for_topic(topic)
    return consumer


def leave_group(bus, group: str) -> None:
    """Make every member of ``group`` leave, as their clients' LeaveGroup would: for a test whose clients
    are gone but whose members stay by design (a static member, which does not leave on close; a raw
    protocol client's member, until its session times out), so that the shared cluster can
    delete the group when the test ends (``SharedBus.tidy``)."""
    import ray

    from logbus.actors.remote import unwrap
    from logbus.errors import InvalidGroupIdError

    try:
        described = ray.get(bus.controller.describe_group.remote(group), timeout=60)
    except Exception as error:  # noqa: BLE001 (no such group: nothing to leave)
        if isinstance(unwrap(error), InvalidGroupIdError):
            return
        raise
    for member in described["members"]:
        ray.get(bus.controller.group_leave.remote(group, member["member_id"], member["group_instance_id"]), timeout=60)


class LeftoverGroupWarning(UserWarning):
    """A test left a consumer group with live members on the shared cluster (``SharedBus.tidy``)."""


def _ray_session_id() -> str:
    """Which Ray session this process is connected to now (a test or a module may have started another):
    its node's id, which a new session never reuses."""
    import ray

    return ray.get_runtime_context().get_node_id()


class SharedBus:
    """The logbus cluster that tests share (see ``bus``): started on first use, replaced if a test broke it
    or if the Ray session it ran on was replaced.

    Besides the topics and groups each test makes, which are deleted when it ends, the cluster holds
    what a module makes once for all its tests (``kept``: a topic produced once, a Kafka gateway).
    That lasts until the module ends (``end_module``), or until the cluster is replaced, and is then
    made again on the new cluster for the next test that asks for it. Not thread-safe: fixtures use it
    from pytest's thread.
    """

    def __init__(self, tmp_path_factory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self.bus = None  # the cluster now (a Bus), None until a test asks for it
        self._session = None  # the Ray session it runs on (_ray_session_id)
        self._kept: dict = {}  # key -> what ``kept`` made for it on this cluster
        self._kept_topics: set[str] = set()  # the topics ``kept`` made: each test's tidy leaves them
        self._stops: list = []  # what ``kept`` asked to run when the cluster closes, in the order made

    def current(self):
        """The cluster, started now if it is not yet, or again if a test ended its controller."""
        import ray

        start_ray()  # a test or a module may have ended the Ray session
        if self.bus is not None and self._session != _ray_session_id():
            self._forget()  # it went with the Ray session it ran on
        if self.bus is not None:
            try:
                ray.get(self.bus.controller.ping.remote(), timeout=60)
                return self.bus
            except Exception:  # noqa: BLE001 (a test killed it for good: start another)
                self.close()
        self.bus = own_bus(str(self._tmp_path_factory.mktemp("shared-data")))
        self._session = _ray_session_id()
        # A node's agent stops once the node hosts no replica (an idle node is what an autoscaler
        # removes), and each test deletes its topics when it ends: the node's agent was started again
        # for nearly every test (about 0.7 CPU-seconds each, some 200 a run). The offsets topic, which
        # any cluster a group has used holds anyway, is a replica that outlives the tests (not listed).
        ray.get(self.bus.controller.ensure_offsets_topic.remote(), timeout=120)
        return self.bus

    def topics(self) -> set[str]:
        import ray

        return set(ray.get(self.bus.controller.list_topics.remote(), timeout=60))

    def groups(self) -> set[str]:
        import ray

        return {g[0] for g in ray.get(self.bus.controller.list_groups.remote(), timeout=60)}

    def kept(self, key: str, make, stop=None):
        """What ``make(bus)`` made for ``key`` on the current cluster, made now if this cluster has none yet.

        The topics ``make`` creates are the module's: no test's tidy deletes them. ``stop(value)``, if
        given, runs when the cluster is closed (the module's end, or a test broke it).
        """
        bus = self.current()
        if key not in self._kept:
            before = self.topics()
            value = make(bus)
            self._kept_topics |= self.topics() - before
            self._kept[key] = value
            if stop is not None:
                self._stops.append(lambda: stop(value))
        return self._kept[key]

    def tidy(self, test: str, topics_before: set[str], groups_before: set[str]) -> None:
        """Delete the topics and groups ``test`` made, so the next test starts as it did.

        A cluster the test broke is closed instead: the next test gets a new one. So is a cluster where
        the test left a group with live members (a consumer or a Kafka client it did not close, still
        heartbeating or within its session timeout), which cannot be deleted: its consumer would go on
        working on the cluster the next tests use. That is reported (a LeftoverGroupWarning in pytest's
        warnings summary, naming the test and the groups), and the test does not fail for it.
        """
        import ray

        from logbus.actors.remote import unwrap
        from logbus.errors import GroupNotEmptyError, InvalidGroupIdError

        left: list[str] = []
        try:
            for group in sorted(self.groups() - groups_before):
                try:
                    ray.get(self.bus.controller.delete_group.remote(group), timeout=60)
                except Exception as error:  # noqa: BLE001 (sorted out below)
                    cause = unwrap(error)
                    if isinstance(cause, GroupNotEmptyError):
                        left.append(group)
                    elif not isinstance(cause, InvalidGroupIdError):  # gone meanwhile: nothing to delete
                        raise
            if not left:
                for topic in self.topics() - topics_before - self._kept_topics:
                    ray.get(self.bus.controller.delete_topic.remote(topic), timeout=120)
                    self.bus.forget(topic)
        except Exception:  # noqa: BLE001 (a cluster the test broke: the next test gets a new one)
            self.close()
            return
        if left:
            warnings.warn(LeftoverGroupWarning(
                f"{test} left consumer group(s) {', '.join(left)} with live members on the shared logbus "
                "cluster (a consumer or Kafka client not closed?): the next test gets a new cluster"))
            self.close()

    def end_module(self) -> None:
        """A module's tests are done: stop what it kept and delete the topics it made; the cluster stays
        for the next module (closed instead if that fails: the next module gets a new one)."""
        import ray

        self._stop_kept()
        topics, self._kept_topics = self._kept_topics, set()
        if self.bus is None or not topics:
            return
        try:
            if self._session != _ray_session_id():
                self._forget()
                return
            for topic in topics:
                ray.get(self.bus.controller.delete_topic.remote(topic), timeout=120)
                self.bus.forget(topic)
        except Exception:  # noqa: BLE001 (a cluster the module broke: the next module gets a new one)
            self.close()

    def _stop_kept(self) -> None:
        while self._stops:
            try:
                self._stops.pop()()
            except Exception:  # noqa: BLE001 (best-effort, as close_bus: it may be gone with a broken cluster)
                pass
        self._kept.clear()

    def _forget(self) -> None:
        """Let go of a cluster whose Ray session is gone (nothing of it is left to stop)."""
        self._stops.clear()
        self._kept.clear()
        self._kept_topics.clear()
        self.bus = None

    def close(self) -> None:
        """Stop what ``kept`` made (last made, first stopped), then the cluster: its topics and controller."""
        self._stop_kept()
        self._kept_topics.clear()
        if self.bus is not None and self._session != _ray_session_id():
            self._forget()
        if self.bus is not None:
            bus, self.bus = self.bus, None
            close_bus(bus)


@pytest.fixture(scope="session")
def worker_bus_state(ray_session, tmp_path_factory):
    """The logbus cluster that the modules run by this process share (a :class:`SharedBus`; see ``bus``)."""
    state = SharedBus(tmp_path_factory)
    yield state
    if ray_session.is_initialized():
        state.close()


@pytest.fixture(scope="module")
def module_bus_state(request, ray_session, worker_bus_state, tmp_path_factory):
    """The logbus cluster that a module's tests share (a :class:`SharedBus`; see ``bus``), started on first use:
    the one this process's modules share, or one of the module's own if it is marked ``cluster_of_its_own``."""
    if request.node.get_closest_marker("cluster_of_its_own"):
        state = SharedBus(tmp_path_factory)
        yield state
        if ray_session.is_initialized():
            state.close()
        return
    yield worker_bus_state
    if ray_session.is_initialized():
        worker_bus_state.end_module()


@pytest.fixture
def bus(request, ray_session, module_bus_state):
    """A logbus cluster for one test.

    The tests of the modules a process runs share one cluster (a controller and a node agent are a
    Ray worker process each to start, which every test, then every module, paid): each test makes
    topics and groups of its own, and they are deleted when it ends (a group it leaves with live
    members is reported, and the next test gets a new cluster: ``SharedBus.tidy``). What a module
    makes once for all its tests (a topic produced once, a Kafka gateway) it makes with
    ``module_bus_state.kept``; that goes when the module ends. A module marked ``cluster_of_its_own``
    (it leaves state no test deletes: ACLs, users) shares a cluster of its own among its tests. A
    test that asks for ``data_dir`` (it looks at the files), or that is marked ``own_bus`` (it
    changes the cluster as a whole), gets a cluster of its own.
    """
    if "data_dir" in request.fixturenames or request.node.get_closest_marker("own_bus"):
        connected = own_bus(request.getfixturevalue("data_dir"))
        yield connected
        if ray_session.is_initialized():
            close_bus(connected)
        return
    shared = module_bus_state.current()
    topics_before, groups_before = module_bus_state.topics(), module_bus_state.groups()
    yield shared
    if ray_session.is_initialized():
        module_bus_state.tidy(request.node.nodeid, topics_before, groups_before)


# The suite's JVMs (Spark's driver, RayDP's application master and executor) compile with the JIT's
# first tier only: they live minutes and run little code often, and without the optimising compiler
# their CPU about halves. tests/api/test_spark.py alone: the JVMs' CPU 31-46 s in three runs against
# 62 s in two, the module 57-62 s against 70-73 s (perf/RESULTS.md). What the tests check does not change.
SPARK_TEST_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"


@pytest.fixture(scope="session")
def spark(ray_session):
    """One RayDP Spark session for the whole run: 1 executor of 1 core (the shared Ray has 4 CPUs)."""
    import logbus.spark

    start_ray()
    session = logbus.spark.init_spark(
        "logbus-tests",
        num_executors=1,
        executor_cores=1,
        executor_memory="1GB",
        configs={"spark.ui.showConsoleProgress": "false", "spark.sql.shuffle.partitions": "4",
                 **{key: SPARK_TEST_JAVA_OPTIONS for key in logbus.spark.JAVA_OPTION_KEYS}},
    )
    yield session
    logbus.spark.stop_spark()


@pytest.fixture
def topic_name(request):
    return "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[:60] + "-" + uuid.uuid4().hex[:6]


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
RAY_FREE_DIRS = ("storage", "protocol")
# Modules that replace the shared Ray session with a multi-node cluster: last in tests/actors, so
# that the shared session is started once before them and once after (in tests/api), and the
# modules of the three-node cluster (tests/actors/conftest.py) one after another, sharing it.
CLUSTER_MODULES = {
    "test_reassign.py": 1,  # a cluster of its own (four nodes in racks)
    "test_compaction_replicas.py": 2,
    "test_gateway_failover.py": 2,
    "test_replication.py": 2,
    "test_broken_invariant.py": 2,
    "test_tier_failover.py": 2,
}


def run_order(item) -> tuple[int, int]:
    parts = os.path.relpath(str(item.fspath), TESTS_DIR).split(os.sep)
    if parts[0] in RAY_FREE_DIRS or len(parts) == 1:
        return (0, 0)  # the Ray-free suites first: they fail fast and need no cluster
    if parts[0] == "actors":
        return (1, CLUSTER_MODULES.get(parts[-1], 0))
    return (2, 0)


def pytest_collection_modifyitems(config, items):
    items.sort(key=run_order)  # stable: files keep their order within each group
    check_worker_groups(items)


# ./dev test runs the main suite on two pytest-xdist workers, each a process with a Ray session of
# its own. A test module is never split between them (its tests share the module's logbus cluster,
# ``bus``), and modules that share a fixture dear to start run on one worker, one after another.
SHARED_FIXTURE_MODULES = {
    "three_node_cluster": {f"actors/{name}" for name, rank in CLUSTER_MODULES.items() if rank == 2},
    "spark": {"api/test_spark.py", "api/test_spark_stream.py", "api/test_tier.py", "api/test_transactional_pipelines.py"},
}
# Modules that end the worker's Ray session and start another (a multi-node cluster, a restart, a
# session reporting metrics every second): they are handed out before the Spark modules, so that no
# worker replaces the Ray its Spark session runs on.
REPLACES_RAY = SHARED_FIXTURE_MODULES["three_node_cluster"] | {"actors/test_reassign.py", "api/test_restart.py", "actors/test_metrics.py"}


def worker_group(module: str) -> str:
    """The unit of work a test module (its path under tests/) belongs to on pytest-xdist's workers."""
    return next((fixture for fixture, modules in SHARED_FIXTURE_MODULES.items() if module in modules), module)


def check_worker_groups(items) -> None:
    """Refuse a run where a module uses a shared fixture without being listed with it in
    ``SHARED_FIXTURE_MODULES`` (under pytest-xdist it would start a second copy on the other worker), or
    starts Ray again for its metrics without being listed in ``REPLACES_RAY`` (it could end the Ray a
    Spark session runs on)."""
    for item in items:
        module = os.path.relpath(str(item.fspath), TESTS_DIR)
        if "metrics_every_second" in getattr(item, "fixturenames", ()) and module not in REPLACES_RAY:
            raise pytest.UsageError(f"{module} starts Ray again (metrics_every_second): list it in REPLACES_RAY in tests/conftest.py")
        for fixture, modules in SHARED_FIXTURE_MODULES.items():
            if fixture in getattr(item, "fixturenames", ()) and module not in modules:
                raise pytest.UsageError(f"{module} uses the {fixture} fixture: list it in SHARED_FIXTURE_MODULES[{fixture!r}] "
                                        "in tests/conftest.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for this suite: whole modules (``worker_group``) as units of work, the
    Ray-replacing ones first, then the Spark ones, then the rest, largest first and Ray-free last."""
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    def rank(unit) -> tuple:
        scope, tests = unit
        ray_free = scope.split("/")[0] in RAY_FREE_DIRS or "/" not in scope
        return (0 if scope in REPLACES_RAY or scope == "three_node_cluster" else 1 if scope == "spark" else 3 if ray_free else 2,
                -len(tests))

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid.split("::", 1)[0].removeprefix("tests/"))

        def _assign_work_unit(self, node) -> None:
            # Sorted at every hand-out (a few hundred units): units a crashed worker left are queued again.
            self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=rank))
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """An S3-compatible server for the run (moto's, a real HTTP server process from PyPI) on
    127.0.0.1; yields a function of a bucket name giving an ``s3://`` URI that pyarrow opens, with
    the server's address and test credentials in it. The server is ended by pid."""
    import re
    import subprocess

    log_path = tmp_path_factory.mktemp("s3") / "server.log"
    server = os.path.join(os.path.dirname(sys.executable), "moto_server")
    with open(log_path, "wb") as log:
        process = subprocess.Popen([server, "-H", "127.0.0.1", "-p", "0"], stdout=log, stderr=subprocess.STDOUT)
    try:
        def address():
            found = re.search(rb"Running on http://127\.0\.0\.1:(\d+)", log_path.read_bytes())
            if found is None and process.poll() is not None:
                raise AssertionError(f"the S3 server ended: {log_path.read_text(errors='replace')}")
            return found and int(found.group(1))

        port = wait_for(address, timeout_s=60, message="the S3 server's port")

        def uri(bucket: str) -> str:
            return (f"s3://test:test@{bucket}/tier?endpoint_override=127.0.0.1:{port}&scheme=http"
                    "&region=us-east-1&allow_bucket_creation=true&allow_bucket_deletion=true")

        yield uri
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
