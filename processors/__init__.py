"""The pure core of agentruns: run state, events, effects and the transition function."""

from agentruns.processors.transition import Disposition, Transition, fold, transition

__all__ = ["Disposition", "Transition", "fold", "transition"]
