from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler, TokenOutput

__all__ = ["Scheduler", "SchedulerConfig", "TokenOutput"]
