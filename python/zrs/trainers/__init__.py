"""The training libraries that own a user's loop and its checkpoints, on a sharded model:
Accelerate today (`accelerate.py`: `from zrs.trainers.accelerate import Accelerator`). Each
module imports its library, which zrs does not depend on, so none is imported here
(docs/integrations.md)."""
