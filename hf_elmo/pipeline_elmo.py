"""Token classification (NER, tagging) pipeline for ELMo models.

The stock `TokenClassificationPipeline` reads one integer id per token (`int(input_ids[idx])`) and asks only fast
tokenizers for offsets; ELMo gives each word a row of character ids and `ElmoTokenizer` (a Python tokenizer) knows
every word's character span. This subclass asks for the spans, takes each entity's text straight from the input,
and treats every position as a whole word (so the `first`, `average` and `max` aggregations are allowed too).

`ElmoForTokenClassification` names this class in `config.custom_pipelines` and its folders carry this file, so
`pipeline("token-classification", model=folder, trust_remote_code=True)` uses it with or without hf_elmo installed.
In-process, pass it explicitly: `pipeline("token-classification", model=model, tokenizer=tokenizer,
pipeline_class=ElmoTokenClassificationPipeline)`.

This file is copied into saved model folders: it imports nothing from hf_elmo.
"""

import torch
from transformers.pipelines.token_classification import AggregationStrategy, TokenClassificationPipeline


class ElmoTokenClassificationPipeline(TokenClassificationPipeline):
    def check_model_type(self, supported_models):
        # The stock check lists built-in architectures only; a registered or remote-code ELMo head is fine.
        if getattr(self.model.config, "model_type", None) == "elmo":
            return
        super().check_model_type(supported_models)

    def _sanitize_parameters(self, aggregation_strategy=None, **kwargs):
        # The stock check refuses first/average/max for Python tokenizers because they cannot tell sub-words apart;
        # here every position is a whole word, so each of those reduces to scoring the word itself.
        if isinstance(aggregation_strategy, str):
            aggregation_strategy = AggregationStrategy[aggregation_strategy.upper()]
        word_level = aggregation_strategy in (AggregationStrategy.FIRST, AggregationStrategy.AVERAGE, AggregationStrategy.MAX)
        preprocess, forward, postprocess = super()._sanitize_parameters(
            aggregation_strategy=None if word_level else aggregation_strategy, **kwargs
        )
        if word_level:
            postprocess["aggregation_strategy"] = aggregation_strategy
        return preprocess, forward, postprocess

    def preprocess(self, sentence, offset_mapping=None, **preprocess_params):
        preprocess_params.pop("tokenizer_params", None)
        if preprocess_params.get("is_split_into_words"):
            if not isinstance(sentence, list):
                raise ValueError("With is_split_into_words=True, each input must be a list of words.")
            delimiter = preprocess_params["delimiter"]
            words, spans, start = sentence, [], 0
            for word in words:
                spans.append((start, start + len(word)))
                start += len(word) + len(delimiter)
            sentence = delimiter.join(words)
            inputs = self.tokenizer(words, is_split_into_words=True, return_tensors="pt", return_special_tokens_mask=True)
            # The tokenizer's offsets are relative to each word; these are spans of the joined sentence.
            inputs["offset_mapping"] = torch.tensor(spans, dtype=torch.long).reshape(1, len(spans), 2)
        else:
            if not isinstance(sentence, str):
                raise ValueError("Without is_split_into_words=True, each input must be a string.")
            inputs = self.tokenizer(
                sentence, return_tensors="pt", return_special_tokens_mask=True, return_offsets_mapping=True
            )
        model_inputs = dict(inputs)
        if offset_mapping is not None:
            model_inputs["offset_mapping"] = offset_mapping
        model_inputs["sentence"] = sentence
        model_inputs["is_last"] = True
        yield model_inputs

    def gather_pre_entities(
        self,
        sentence,
        input_ids,
        scores,
        offset_mapping,
        special_tokens_mask,
        aggregation_strategy,
        word_ids=None,
        word_to_chars_map=None,
    ):
        pre_entities = []
        for index, word_scores in enumerate(scores):
            if special_tokens_mask[index]:
                continue
            if offset_mapping is not None:
                start, end = (int(value) for value in offset_mapping[index])
                word = sentence[start:end]
            else:
                start = end = None
                word = self.tokenizer.convert_ids_to_tokens(input_ids[index])
            pre_entities.append(
                {"word": word, "scores": word_scores, "start": start, "end": end, "index": index, "is_subword": False}
            )
        return pre_entities

    def postprocess(self, all_outputs, aggregation_strategy=AggregationStrategy.NONE, ignore_labels=None):
        entities = super().postprocess(all_outputs, aggregation_strategy=aggregation_strategy, ignore_labels=ignore_labels)
        sentence = all_outputs[0]["sentence"]
        for entity in entities:
            # A grouped entity's text is the span of the input it covers, not its words joined by spaces.
            if entity.get("start") is not None:
                entity["word"] = sentence[entity["start"] : entity["end"]]
        return entities


__all__ = ["ElmoTokenClassificationPipeline"]
