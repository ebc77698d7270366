"""Run prepared QEMU jobs (runner.Launch) on a Dask distributed cluster.

``linepack evaluate --scheduler tcp://HOST:8786`` sends its boots here instead
of the local process pool. Inputs (kernel images, initramfs, plugin .so, disk
images) are shipped once per worker machine and kept there under
``$LINEPACK_WORKER_INPUTS`` (default ``cache_dir()/worker-inputs``) by the
sha256 of their bytes, so a second sweep over the same images ships nothing.
Workers run QEMU themselves: they need qemu-system-x86_64 (qemu-user for
programs) and this package importable, nothing else (no compiler, no kernel).

A worker that dies mid-sweep loses its running job; the scheduler gives it to
another worker (``retries`` on top of Dask's own re-run of lost tasks), and
the results are gathered in job order, so the table is the same.
"""

import os
import uuid

from ..io import file_hash

CHUNK = 32 << 20          # bytes per message when shipping an input


def _inputs_dir():
    d = os.environ.get("LINEPACK_WORKER_INPUTS")
    if not d:
        from ..targets import cache_dir
        d = os.path.join(cache_dir(), "worker-inputs")
    os.makedirs(d, exist_ok=True)
    return d


def _have(hashes):
    """On a worker: which of these inputs it already holds."""
    d = _inputs_dir()
    return [h for h in hashes if os.path.exists(os.path.join(d, h))]


def _write_chunk(h, token, offset, data):
    """On a worker: one piece of an input, into a private part file."""
    part = os.path.join(_inputs_dir(), f"{h}.{token}.part")
    with open(part, "r+b" if offset else "wb") as f:
        f.seek(offset)
        f.write(data)
    return len(data)


def _finish(h, token, mode):
    """On a worker: check the shipped bytes against their hash, then publish them."""
    d = _inputs_dir()
    part = os.path.join(d, f"{h}.{token}.part")
    if file_hash(part) != h:
        os.unlink(part)
        raise IOError(f"input {h[:12]} arrived damaged")
    os.chmod(part, mode)
    os.replace(part, os.path.join(d, h))       # atomic: readers see all or nothing
    return True


def ship_inputs(client, files, log=None):
    """Send every input (``{hash: path}``) to every worker that lacks it."""
    log = log or (lambda m: None)
    workers = sorted(client.scheduler_info()["workers"])
    if not workers:
        raise RuntimeError("the Dask cluster has no workers")
    for w in workers:
        have = set(client.run(_have, sorted(files), workers=[w])[w])
        for h, path in sorted(files.items()):
            if h in have:
                continue
            token = uuid.uuid4().hex
            size = os.path.getsize(path)
            log(f"shipping {os.path.basename(path)} ({size / 1e6:.1f} MB) to {w}")
            with open(path, "rb") as f:
                off = 0
                while True:
                    data = f.read(CHUNK)
                    if not data and off:
                        break
                    client.run(_write_chunk, h, token, off, data, workers=[w])
                    off += len(data)
                    if not data:
                        break
            client.run(_finish, h, token, os.stat(path).st_mode & 0o777, workers=[w])
            # a worker sharing this disk with the next one: it has it too now
            have.add(h)


def _remote_execute(execute, launch, hashes):
    """On a worker: run a Launch from the worker's copies of its inputs
    (``execute``: runner.execute, passed in so this module needs no runner)."""
    d = _inputs_dir()
    paths = {}
    for role, h in hashes.items():
        p = os.path.join(d, h)
        if not os.path.exists(p):
            # a worker that joined after the inputs were shipped: the client's own
            # path works when the disk is shared (it is checked by hash)
            orig = launch.inputs[role]
            if os.path.exists(orig) and file_hash(orig) == h:
                p = orig
            else:
                raise FileNotFoundError(f"input {role} ({h[:12]}) was not shipped to this worker")
        paths[role] = p
    return execute(launch, paths)


def connect(scheduler, timeout=30):
    """A Client of the cluster at ``scheduler`` (an address), or the Client given."""
    try:
        from distributed import Client
    except ImportError:
        from ..errors import BadInput
        raise BadInput("--scheduler needs Dask's distributed package "
                       "(pip install 'dask[distributed]')") from None
    if isinstance(scheduler, Client):
        return scheduler, False
    from ..errors import ExternalToolError
    try:
        return Client(scheduler, timeout=timeout), True
    except (OSError, TimeoutError) as e:
        raise ExternalToolError(f"cannot reach the Dask scheduler at {scheduler}: {e}") from None


def run_on_cluster(launches, scheduler, on_done, execute, log=None, retries=3):
    """Run ``launches`` on the cluster; ``on_done(index, JobResult)`` as each finishes.
    ``execute(launch, paths)`` runs one launch on a worker (runner.execute)."""
    if not launches:
        return
    client, own = connect(scheduler)        # names a missing dask/distributed in one line
    from distributed import as_completed
    try:
        files, hashes = {}, []
        for la in launches:
            hs = {}
            for role, p in la.inputs.items():
                h = hs[role] = file_hash(p)
                files[h] = p
            hashes.append(hs)
        ship_inputs(client, files, log)
        tag = uuid.uuid4().hex[:8]
        futs = [client.submit(_remote_execute, execute, la, hs, key=f"linepack-{tag}-{k}",
                              pure=False, retries=retries)
                for k, (la, hs) in enumerate(zip(launches, hashes))]
        index = {f.key: k for k, f in enumerate(futs)}
        for f in as_completed(futs):
            on_done(index[f.key], f.result())
    finally:
        if own:
            client.close()


__all__ = ["run_on_cluster", "ship_inputs", "connect"]
