# Scheduler itself: `minisgl.scheduler.scheduler` (torch), imported where used; SchedulerConfig
# is read by processes without torch (issue 47)
from minisgl.scheduler.config import SchedulerConfig

__all__ = ["SchedulerConfig"]
