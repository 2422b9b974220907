"""The --arch presets: annotated_transformer with other defaults, as fairseq's
transformer_legacy.py has its own. Each is a model name with its own config class, so that `--arch NAME` on the command
line and `model._name: NAME` in a fairseq-hydra-train recipe start from the same values
(docs/reference.md#presets).
"""

from dataclasses import field, fields, make_dataclass

from fairseq.models import register_model

from .annotated_transformer import AnnotatedTransformerModel
from .config import AnnotatedTransformerConfig


def register_preset(name: str, summary: str, **defaults):
    """Register the model ``name``: annotated_transformer with ``defaults``."""
    config = make_dataclass(
        "".join(part.title() for part in name.split("_")) + "Config",
        [(f.name, f.type, field(default=defaults.get(f.name, f.default), metadata=f.metadata))
         for f in fields(AnnotatedTransformerConfig)],
        bases=(AnnotatedTransformerConfig,))
    config.__doc__, config.__module__ = summary, __name__
    model = type(config.__name__.replace("Config", "Model"), (AnnotatedTransformerModel,),
                 {"__doc__": summary, "__module__": __name__})
    return register_model(name, dataclass=config)(model)


register_preset("annotated_transformer_iwslt_de_en",
                "Like fairseq's transformer_iwslt_de_en: 6+6 layers, d_model 512, d_ff 1024, 4 heads.",
                encoder_ffn_embed_dim=1024, encoder_attention_heads=4, decoder_attention_heads=4)
register_preset("annotated_transformer_big",
                "The paper's big model: d_model 1024, d_ff 4096, h=16, P_drop 0.3.",
                encoder_embed_dim=1024, encoder_ffn_embed_dim=4096, encoder_attention_heads=16,
                decoder_attention_heads=16, dropout=0.3)
register_preset("annotated_transformer_tiny",
                "Small and fast, for tests and sanity tasks: 2+2 layers, d_model 64, d_ff 256, 4 heads.",
                encoder_embed_dim=64, encoder_ffn_embed_dim=256, encoder_layers=2,
                decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4)
