#!/usr/bin/env python
"""Train and evaluate p-LaT language models: the job lives in ``plat_train.causal_lm`` (see its docstring);
installed, the same command is ``plat-run-clm``.

    python run_clm.py plat-ptb-tiny.yaml
"""

from plat_train.causal_lm import main

if __name__ == "__main__":
    main()
