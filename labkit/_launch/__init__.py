"""Launching: a script on N ranks with torchrun, watched live and cleaned up after.

Owns, in the order a launch uses them:
    plan        checks at the door: every argument, before anything starts
    keywords    a wrong or old keyword gets a did-you-mean (``timeout`` -> ``timeout_s``)
    command     the torchrun command of each agent, the ranks' environment, run.json's facts
    agents      the torchrun agents of a launch (one per node), started, watched, stopped
    forked      an agent started warm from ``labkit._rank.agent_server`` (torch already loaded)
    elastic     agents that may be killed and added while the job trains (``min_nodes``)
    procs       which ranks still run, their children, signals to a tree (psutil)
    launch      ``launch``: the steps, and the poll loop
    streams     every rank's output, live, with its ``[rankN]`` prefix
    events      ``events=``: what a launch does while it runs; ``Progress``, ``hang_timeout_s``
    supervise   stopping a launch; asking its ranks where they are
    failures    what failed, root cause first, and its HINT
    tracebacks  an interrupted launch's traceback without labkit's frames
    live        the progress line (step of the total, samples/s, time left), live in the cell
    live_chart  its loss chart: one line per rank and stretch, each round marked
    stop        the live view's Stop button: the toolbar's interrupt, sent from the page
    tail        following a file that grows, line by line
    sweep       ``sweep``: several world sizes, repeated
    sbatch      ``sbatch``, ``slurm_status``: a second launcher, through Slurm

Imported by the kernel only (``labkit.launch``, ``labkit.sweep``, ``labkit.sbatch``, the
exercises' checks, ``labkit.doctor``); never by a rank (``labkit._rank`` is the rank side).
Standard library, plus psutil in ``procs``; reading a run never imports torch.
"""
