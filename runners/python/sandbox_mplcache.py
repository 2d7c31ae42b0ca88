"""Seed matplotlib's font cache into $MPLCONFIGDIR (sandbox-broker runner).

Runs at interpreter start via sandbox_mplcache.pth. /tmp is an empty tmpfs in
sandboxes, so the font cache built at image build time lives read-only in
/usr/local/share/matplotlib-cache and is copied here once, which saves the
font scan on the first plot. Costs one stat() when the cache is present and
never raises.
"""
import os


def _seed(src="/usr/local/share/matplotlib-cache"):
    dst = os.environ.get("MPLCONFIGDIR")
    if not dst:
        return
    try:
        names = [n for n in os.listdir(src) if n.startswith("fontlist-")]
        for name in names:
            target = os.path.join(dst, name)
            if os.path.exists(target):
                continue
            os.makedirs(dst, mode=0o700, exist_ok=True)
            with open(os.path.join(src, name), "rb") as f:
                data = f.read()
            tmp = "%s.%d.tmp" % (target, os.getpid())
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
    except OSError:
        pass


_seed()
del _seed
