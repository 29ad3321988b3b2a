"""Configuration values every family shares."""

# Vocabulary size of the DeepSeek-V3 tokenizer as the published configs declare it (128K BPE + specials,
# padded); the tiny presets use it so the real tokenizer's ids always fit.
DEEPSEEK_V3_VOCAB = 129280

# Fields that training adds on top of the architecture. Only aux_loss_alpha has a config.json form (DeepSeek's
# own configs carry it): it is read from there and written back as what trained.
TRAINING_FIELDS = ("aux_loss_alpha", "bias_update_speed", "mtp_loss_weight")
