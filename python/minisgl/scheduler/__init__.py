from minisgl.scheduler.scheduler import Scheduler, SchedulerConfig, TokenOutput

__all__ = ["Scheduler", "SchedulerConfig", "TokenOutput"]
