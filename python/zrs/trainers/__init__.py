"""The training libraries that own a user's loop and its checkpoints, on a sharded model:
Accelerate (`accelerate.py`: `from zrs.trainers.accelerate import Accelerator`), Hugging Face's
Trainer (`hf.py`) and PyTorch Lightning (`lightning.py`: `Strategy`). Each module imports its
library, which zrs does not depend on, so none is imported here (docs/integrations.md)."""
