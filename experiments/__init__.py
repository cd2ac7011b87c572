"""Entry points: thin absl mains over `qjax.pipeline`, run from the repository root as
`python -m experiments.<name> --config=configs/<file>.py` (train, quantize, sweep, demo, qat,
gemma_ptq, plan). Nothing imports this package; reusable code lives in `qjax`."""
