"""Training backends other than CONA's own engine (``cona train --backend``)."""
