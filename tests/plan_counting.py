"""Counting the packing planner's work: how often a plan is built (``plan_packing``) and how
often one is looked up from a boundaries tensor (the cache behind batches built outside the
project)."""
import sp_attention.planning.packing as packing


def count_plan_calls(monkeypatch, *importers) -> dict:
    """``{"plan": n, "lookup": m}``, counting from now; ``importers``: modules that imported
    ``plan_packing`` by name."""
    calls = {"plan": 0, "lookup": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    plan = counted("plan", packing.plan_packing)
    for module in (packing,) + importers:
        monkeypatch.setattr(module, "plan_packing", plan)
    monkeypatch.setattr(packing, "_plan_of_tensor", counted("lookup", packing._plan_of_tensor))
    return calls
