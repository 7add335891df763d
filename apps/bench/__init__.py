"""``duelq bench``: the learner service's throughput, side by side with a bare gRPC byte stream.

Each figure is measured in one run next to its ceiling, and printed as a ratio to it:

* ``echo``   a bare gRPC bidi stream of bytes (a generic handler, no protobuf, no numpy)
             that answers each request with a reply the size of a TrainResponse.  Same
             request size, window, actor count and transport as the cells it is the
             ceiling of: the most the wire and gRPC's Python runtime can carry.
* ``stream`` ``LearnerClient.train_stream`` (``--window`` batches in flight).
* ``unary``  ``LearnerClient.train_step`` in a loop.
* ``replay`` ``LearnerClient.insert_stream`` of B rows into the server's replay buffer,
             which trains from it to hold its replay ratio: learner steps/s, inserted
             rows/s and wire bytes per learner step from the buffer's counters, as ratios
             to ``stream`` of the same B and wire (no echo ceiling).

Actors are processes (``multiprocessing``, spawn), each with its own client and
a few pre-built batches it cycles through, so actor-side work is the client
library's (checks, encode, decode), not data generation.  All actors of a cell
start at the same instant, run ``--warmup`` seconds unmeasured, then count the
answers that arrive during the next ``--duration`` seconds: steps/s is that
count over the duration, summed over actors; transitions/s is steps/s × B.
Latency runs from the moment an actor hands a batch to the client to the moment
its answer is back (client encode, the window's queueing and the server included).

Learner backends: the real one (``--backend``: reference on a CPU, cuda on a GPU)
and ``null`` (every cell also run with a no-op step): decode, validate,
idempotency keys and encode without arithmetic, i.e. what the service path costs
on top of the wire.  Server-side overhead per step is measured in-line on the
in-process server by an interceptor (protobuf parse and serialise in grpc's
(de)serializers, time in the handler) and a timed backend wrapper (``propose``,
``commit``): overhead = parse + handler − propose − commit − lock wait + serialise.
The copy into pinned memory towards the device (``upload``, before the step's turn on
the cuda backend) is not subtracted: it counts as overhead.
A breakdown by phase (tensor decode, validation, response encode) is timed off-line
on the same sizes.  On a cuda backend run from a duelq checkout, the device step time
against PyTorch comes from the checkout's device benchmark.

Output: a markdown table on stdout, ``bench.json`` and ``bench.png`` under ``--out``.

Modules: :mod:`.run` (plan, cells, :func:`run_bench`), :mod:`.servers` (the echo ceiling,
the learner server process, the in-line instruments), :mod:`.actors` (actor processes),
:mod:`.report` (ratios, tables, plot), :mod:`.base` (what they share).

Exit codes: 0 every cell measured, 1 a cell or the device benchmark failed (what
was measured is still written), 2 a usage error.
"""

from duelq.apps.bench.base import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from duelq.apps.bench.run import run_bench

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "run_bench"]
