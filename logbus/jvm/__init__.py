"""logbus's Spark data source, in Java: its sources, and the jar built from them with the JDK's javac.

Spark's executors run in the JVM, so a reader that hands them Arrow with no
Python in between must be a Java class (PySpark 3.5 has no Python data source
API). The sources live here, beside the Python that plans their reads
(:mod:`logbus.spark`); :func:`jar` compiles them against the jars pyspark and
Ray ship (Spark's DataSource V2 and Arrow, Ray's Java API) into a jar kept
next to them. The jar's name holds a digest of the sources and of pyspark's
and Ray's versions, so a changed source or an upgraded pyspark or Ray builds
a new jar. No build tool: ``javac`` and ``jar`` from a JDK (17, as Spark 3.5
runs on).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

from logbus.errors import IllegalStateError

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = os.path.join(HERE, "src")
RESOURCES = os.path.join(HERE, "resources")
JAR_PREFIX = "logbus-spark-"
BUILD_TIMEOUT_S = 300


def _sources() -> list[str]:
    found = glob.glob(os.path.join(SOURCES, "**", "*.java"), recursive=True)
    found += glob.glob(os.path.join(RESOURCES, "**", "*"), recursive=True)
    return sorted(path for path in found if os.path.isfile(path))


def _classpath() -> str:
    import pyspark  # noqa: PLC0415
    import ray  # noqa: PLC0415

    jars = glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "*.jar"))
    jars += glob.glob(os.path.join(os.path.dirname(ray.__file__), "jars", "*.jar"))
    return os.pathsep.join(sorted(jars))


def _tool(name: str) -> str:
    home = os.environ.get("JAVA_HOME")
    if home and os.path.exists(os.path.join(home, "bin", name)):
        return os.path.join(home, "bin", name)
    found = shutil.which(name)
    if found is None:
        raise IllegalStateError(
            f"building logbus's Spark data source needs a JDK's {name} (Debian: apt-get install openjdk-17-jdk-headless)"
        )
    return found


def _digest(sources: list[str]) -> str:
    import pyspark  # noqa: PLC0415
    import ray  # noqa: PLC0415

    digest = hashlib.sha256(f"pyspark {pyspark.__version__} ray {ray.__version__}".encode())
    for path in sources:
        digest.update(os.path.relpath(path, HERE).encode())
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()[:16]


def in_session(spark) -> bool:
    """Whether the SparkSession ``spark`` was started with the data source's jar (``spark.jars``)."""
    return JAR_PREFIX in spark.sparkContext.getConf().get("spark.jars", "")


def jar(directory: str | None = None) -> str:
    """The path of the data source's jar, built first if there is none for these sources and versions.

    ``directory``: where the jar is kept (default: this package's directory, or
    ``~/.cache/logbus`` where that is not writable). Raises IllegalStateError
    when there is no JDK, no sources, or the build fails (with javac's message).
    """
    directory = directory or (HERE if os.access(HERE, os.W_OK) else os.path.expanduser("~/.cache/logbus"))
    sources = _sources()
    if not any(s.endswith(".java") for s in sources):
        raise IllegalStateError(f"logbus's Spark data source has no sources under {SOURCES}")
    name = f"{JAR_PREFIX}{_digest(sources)}.jar"
    path = os.path.join(directory, name)
    if os.path.exists(path):
        return path
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="logbus-jvm-") as build:
            classes = os.path.join(build, "classes")
            java = [s for s in sources if s.endswith(".java")]
            compiled = subprocess.run(
                [_tool("javac"), "--release", "17", "-nowarn", "-encoding", "UTF-8", "-cp", _classpath(), "-d", classes, *java],
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
            )
            if compiled.returncode != 0:
                raise IllegalStateError(f"javac failed building logbus's Spark data source:\n{compiled.stderr[-4000:]}")
            shutil.copytree(RESOURCES, classes, dirs_exist_ok=True)
            staged = os.path.join(build, name)
            packed = subprocess.run(
                [_tool("jar"), "--create", "--file", staged, "-C", classes, "."], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
            )
            if packed.returncode != 0:
                raise IllegalStateError(f"jar failed packing logbus's Spark data source:\n{packed.stderr[-4000:]}")
            partial = f"{path}.{os.getpid()}.partial"
            shutil.copyfile(staged, partial)
            os.replace(partial, path)  # another process building at once replaces it with the same jar
    except (OSError, subprocess.SubprocessError) as error:
        raise IllegalStateError(f"building logbus's Spark data source in {directory} failed: {error}") from error
    # Jars of other sources or versions stay: a running session may still load classes from its own.
    return path
