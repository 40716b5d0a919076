"""Research use of a served model: look inside (`trace`), intervene on image tokens
(`interventions`), differentiate (`gradients`). Everything runs the family's own pure encode and
the text model's forward, the functions the serving steps are built from (with a static
`Capture` where intermediates are wanted, so the serving steps compile as before).

    tr = vlm.trace(messages, layers=(2,), what=("hidden", "attn"))
    tr.heatmap(2, image=0)                              # [rows, cols] attention of the last token
    sal = vlm.saliency(image, "What shape is this?", "circle")   # [H, W]
    vlm.generate([{"prompt": p, "images": [img], "intervention": Pool(2)}])
"""
from mmjax.research.interventions import Ablate, Intervention, Pool, Prune
from mmjax.research.trace import Trace, TracedImage

__all__ = ["Ablate", "Intervention", "Pool", "Prune", "Trace", "TracedImage"]
