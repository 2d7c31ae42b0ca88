"""sandbox-broker agent: matplotlib figures of a fresh Python run.

The agent writes this module into each Python run's directory (lib/) and
makes it matplotlib's backend (MPLBACKEND=module://sandbox_figures), so
that, as with Jupyter's inline backend, plt.show() renders every open
figure as a PNG and closes it; figures still open when the interpreter
exits are rendered too. The PNGs go to the run directory's figures/, which
the agent returns with the run's result and then deletes.
"""
import atexit
import os
import sys

from matplotlib.backends.backend_agg import FigureCanvasAgg

FigureCanvas = FigureCanvasAgg

MAX_FIGURES = 16
_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "figures")
_count = 0


def save_open_figures():
    """Renders every open figure into figures/ and closes it."""
    global _count
    if "matplotlib.pyplot" not in sys.modules:
        return
    from matplotlib._pylab_helpers import Gcf

    managers = Gcf.get_all_fig_managers()
    if not managers:
        return
    for manager in managers:
        if _count >= MAX_FIGURES:
            break
        _count += 1
        try:
            manager.canvas.figure.savefig(
                os.path.join(_DIR, "fig-%03d.png" % _count), format="png", bbox_inches="tight"
            )
        except Exception as e:  # a broken figure must not fail the run
            print("sandbox: figure %d not rendered: %s" % (_count, e), file=sys.stderr)
    Gcf.destroy_all()


def show(*args, **kwargs):
    save_open_figures()


atexit.register(save_open_figures)
