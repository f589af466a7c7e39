"""Diagnosing: where a rank is, what it called, where a step's time went, what a seat offers.

Owns:
    stacks   every "where is a rank" format (faulthandler, py-spy, tracebacks), parsed once,
             said in one form; the excerpt of a dump a cell shows
    hang     ``dump_stack``, ``py_spy_dump``: a hung rank's stack read from outside (lesson 09)
    flight   ``flight_records``: every rank's flight-recorder dump in one table (lesson 09)
    trace    ``read_trace``, ``overlap_ms``, ``plot_timeline``: a torch.profiler trace (lesson 07)
    doctor   ``doctor``: the seat check (lesson 00, ``make doctor``)

Imported by the kernel: the public names above, and the launcher (``stacks``, on a timeout).
"""
