"""Muse-Spark-Open (`muse_spark`): Muse-Glimmer's vision tower, adapter and processors (models/families/
muse_glimmer.py) in a model that also hears; its audio encoder is not served here."""

from models.families.muse_glimmer import MUSE_GLIMMER
from models.family import register

MUSE_SPARK = register(MUSE_GLIMMER.derive(
    model_type="muse_spark", title="Muse-Spark-Open", hf_class="MuseSparkForConditionalGeneration",
))
