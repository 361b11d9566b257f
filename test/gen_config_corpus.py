#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_config.c into test/corpus/config/:
valid configs that use every key of smp.h's CONFIG KEYS (each value of each
enum, both booleans), numbers at their limits, escapes and \\u sequences,
deep nesting, duplicate keys, wrong types and syntax errors, one flaw each.
Standard library only; the output is deterministic.

    python3 test/gen_config_corpus.py [OUT_DIR]
"""
import json
import os
import sys

# every key smp_config_from_json reads, with a non-default value
ALL_KEYS = {
    "partitions": 2,
    "pipeline_parallel_degree": 2,
    "tensor_parallel_degree": 2,
    "microbatches": 4,
    "pipeline": "interleaved",
    "optimize": "speed",
    "auto_partition": True,
    "default_partition": 1,
    "ddp": True,
    "placement_strategy": "cluster",
    "memory_weight": 0.25,
    "trace_device": "cpu",
    "trace_execution_times": True,
    "trace_memory_usage": True,
    "overlapping_allreduce": True,
    "backward_passes_per_step": 2,
    "active_microbatches": 2,
    "average_grads_across_microbatches": True,
    "bucket_cap_mb": 12.5,
    "broadcast_buffers": True,
    "activation_checkpointing": True,
    "virtual_stages": 2,
    "deterministic_reduction": True,
    "timeout": 30,
    "seed": 1234,
}
# the other value of every enum and boolean
ALL_KEYS_ALT = {
    "partitions": 1,
    "tensor_parallel_degree": 1,
    "microbatches": 1,
    "pipeline": "simple",
    "optimize": "memory",
    "auto_partition": False,
    "default_partition": 0,
    "ddp": False,
    "placement_strategy": "spread",
    "memory_weight": 1,
    "trace_device": "gpu",
    "trace_execution_times": False,
    "trace_memory_usage": False,
    "overlapping_allreduce": False,
    "backward_passes_per_step": 1,
    "average_grads_across_microbatches": False,
    "bucket_cap_mb": 1e-3,
    "broadcast_buffers": False,
    "activation_checkpointing": False,
    "virtual_stages": 1,
    "deterministic_reduction": False,
    "timeout": 0.5,
    "seed": 0,
}


def obj(*members):
    """'{' + members joined by ',' + '}'; members are raw JSON text."""
    return "{" + ",".join(members) + "}"


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "config")
    os.makedirs(out, exist_ok=True)
    files = {}
    # ---- valid
    files["valid_all_keys"] = json.dumps(ALL_KEYS, indent=2)
    files["valid_all_keys_alt"] = json.dumps(ALL_KEYS_ALT, separators=(",", ":"))
    files["valid_all_keys_reversed"] = json.dumps(dict(reversed(list(ALL_KEYS.items()))))
    files["valid_zero_bubble"] = '{"pipeline": "zero_bubble", "partitions": 4, "microbatches": 8}'
    files["valid_zero_bubble_v"] = '{"pipeline": "zero_bubble_v", "partitions": 2, "microbatches": 8, "virtual_stages": 2}'
    files["valid_empty"] = "{}"
    files["valid_empty_ws"] = " \t\r\n{ \t\r\n} \t\r\n"
    files["valid_sagemaker"] = ('{"partitions": 2, "microbatches": 4, "placement_strategy": "spread", '
                                '"pipeline": "interleaved", "optimize": "speed", "ddp": true}')
    files["valid_ws_everywhere"] = '\n{\n\t"partitions"\r\n:\t2 ,\n "ddp" :true\n}\n'
    # numbers at their limits (all still accepted by the parser)
    files["valid_int_max"] = '{"partitions": 2147483647, "microbatches": 2147483647, "virtual_stages": 2147483647}'
    files["valid_index_min"] = '{"default_partition": -2147483648}'
    files["valid_seed_max"] = '{"seed": 18446744073709551615}'
    files["valid_seed_neg_zero"] = '{"seed": -0}'
    files["valid_seed_float"] = '{"seed": 1.8446744073709550e19}'
    files["valid_int_as_float"] = '{"partitions": 2.0, "microbatches": 4e0, "backward_passes_per_step": 20E-1}'
    files["valid_double_max"] = '{"memory_weight": 1.7976931348623157e308, "bucket_cap_mb": 1e6, "timeout": 1e9}'
    files["valid_double_tiny"] = '{"memory_weight": 5e-324, "bucket_cap_mb": 2.2250738585072014e-308, "timeout": 1e-300}'
    files["valid_neg_zero_weight"] = '{"memory_weight": -0.0}'
    files["valid_exponent_forms"] = '{"memory_weight": 0.5E+0, "timeout": 1e+01, "bucket_cap_mb": 25e-0}'
    # integer keys spelled with a fraction or an exponent: accepted today through a
    # double (rounded); fuzz_config.c built with -DFUZZ_CONFIG_EXACT_INTEGERS refuses
    # these values, and a 600-digit 2.000... is refused as out of int range
    files["num_seed_float_rounded"] = '{"seed": 12345678901234567890.0}'
    files["num_seed_float_2p53"] = '{"seed": 9007199254740993.0}'
    files["num_count_near_integer"] = '{"partitions": 1.9999999999999999}'
    files["num_index_underflow_zero"] = '{"default_partition": 1e-400}'
    files["num_count_long_integral"] = obj('"partitions": 2.' + "0" * 600)
    # escapes that decode to valid keys and values
    files["valid_escaped_key"] = '{"\\u0070artitions": 2, "pipelin\\u0065": "\\u0073imple"}'
    files["valid_escaped_solidus"] = '{"optimize": "\\u006demory", "trace_device": "gp\\u0075"}'
    # ---- key errors (the syntax is fine)
    files["bad_unknown_key"] = '{"partitons": 2}'
    files["bad_unknown_key_far"] = '{"zzz": 1}'
    files["bad_unknown_prefix"] = '{"micro": 4}'
    files["bad_sagemaker_degree"] = '{"tensor_parallel_degree": 0}'
    files["valid_sagemaker_degrees"] = '{"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "placement_strategy": "PTD"}'
    files["bad_sagemaker_wrapper"] = '{"modelparallel": {"enabled": true, "parameters": {"partitions": 2}}}'
    files["bad_duplicate_key"] = '{"partitions": 2, "microbatches": 2, "partitions": 3}'
    files["bad_duplicate_escaped"] = '{"ddp": true, "d\\u0064p": false}'
    files["bad_key_case"] = '{"Partitions": 2}'
    files["bad_long_key"] = obj('"' + "k" * 200 + '": 1')
    files["bad_long_enum_value"] = obj('"pipeline": "' + "interleaved" * 12 + '"')
    files["bad_key_utf8"] = '{"partitions\u00e9\u2603\U0001F600": 2}'
    files["bad_key_surrogate_pair"] = '{"p\\ud83d\\ude00": 2}'
    files["bad_key_controls"] = '{"a\\u0000b\\n\\t\\u001f\\u007f": 2}'
    # wrong types and values, one per kind of key
    files["bad_count_string"] = '{"partitions": "2"}'
    files["bad_count_zero"] = '{"microbatches": 0}'
    files["bad_count_negative"] = '{"virtual_stages": -1}'
    files["bad_count_fraction"] = '{"microbatches": 1.5}'
    files["bad_count_overflow"] = '{"partitions": 2147483648}'
    files["bad_index_underflow"] = '{"default_partition": -2147483649}'
    files["bad_count_huge"] = '{"partitions": 99999999999999999999999999999}'
    files["bad_count_huge_float"] = '{"partitions": 1e400}'
    files["bad_count_null"] = '{"backward_passes_per_step": null}'
    files["bad_bool_number"] = '{"ddp": 1}'
    files["bad_bool_string"] = '{"auto_partition": "true"}'
    files["bad_enum_number"] = '{"pipeline": 1}'
    files["bad_enum_value"] = '{"placement_strategy": "random"}'
    files["bad_enum_case"] = '{"optimize": "Speed"}'
    files["bad_enum_array"] = '{"trace_device": ["cpu"]}'
    files["bad_seed_negative"] = '{"seed": -1}'
    files["bad_seed_overflow"] = '{"seed": 18446744073709551616}'
    files["bad_seed_fraction"] = '{"seed": 0.5}'
    files["bad_seed_float_overflow"] = '{"seed": 1.8446744073709552e19}'
    files["bad_number_object"] = '{"memory_weight": {}}'
    files["bad_number_overflow"] = '{"memory_weight": 1e309}'
    files["bad_timeout_zero"] = '{"timeout": 0}'
    files["bad_timeout_negative"] = '{"timeout": -5}'
    files["bad_bucket_neg_zero"] = '{"bucket_cap_mb": -0.0}'
    files["bad_long_number"] = obj('"memory_weight": 0.' + "5" * 600)
    files["bad_first_of_two"] = '{"ddp": 1, "pipeline": 2}'
    # deep nesting (SMP__JSON_MAX_DEPTH is 32, the top-level object counts)
    files["bad_nest_31"] = obj('"x": ' + "[" * 31 + "]" * 31)
    files["bad_nest_32"] = obj('"x": ' + "[" * 32 + "]" * 32)
    files["bad_nest_objects"] = obj('"x": ' + '{"a":' * 30 + "1" + "}" * 30)
    files["bad_nest_mixed"] = obj('"x": [{"a": [{"b": [1, 2.5e-3, "s\\u00e9", null, true, false]}]}]')
    # ---- syntax errors
    files["syn_empty"] = ""
    files["syn_ws_only"] = "  \n"
    files["syn_top_array"] = '[{"partitions": 2}]'
    files["syn_top_string"] = '"partitions"'
    files["syn_unclosed"] = '{"partitions": 2'
    files["syn_unclosed_string"] = '{"partitions'
    files["syn_trailing_comma"] = '{"partitions": 2,}'
    files["syn_trailing_comma_array"] = obj('"x": [1,]')
    files["syn_trailing_garbage"] = '{"partitions": 2} x'
    files["syn_two_objects"] = '{}{}'
    files["syn_missing_colon"] = '{"partitions" 2}'
    files["syn_missing_comma"] = '{"partitions": 2 "ddp": true}'
    files["syn_single_quotes"] = "{'partitions': 2}"
    files["syn_python_literals"] = '{"ddp": True, "x": None}'
    files["syn_leading_zero"] = '{"partitions": 02}'
    files["syn_leading_plus"] = '{"partitions": +2}'
    files["syn_bare_dot"] = '{"memory_weight": .5}'
    files["syn_dot_no_digit"] = '{"memory_weight": 1.}'
    files["syn_exp_no_digit"] = '{"memory_weight": 1e}'
    files["syn_minus_alone"] = '{"memory_weight": -}'
    files["syn_nan"] = '{"memory_weight": NaN}'
    files["syn_infinity"] = '{"memory_weight": -Infinity}'
    files["syn_hex"] = '{"partitions": 0x10}'
    files["syn_comment"] = '{"partitions": 2 // two\n}'
    files["syn_bad_escape"] = '{"a\\x41": 1}'
    files["syn_short_u"] = '{"a\\u12": 1}'
    files["syn_lone_low_surrogate"] = '{"a\\udc00": 1}'
    files["syn_lone_high_surrogate"] = '{"a\\ud800": 1}'
    files["syn_high_then_high"] = '{"a\\ud800\\ud800": 1}'
    files["syn_raw_newline"] = '{"a\nb": 1}'
    files["syn_raw_tab"] = '{"pipeline": "simple\t"}'
    files["syn_nest_33"] = obj('"x": ' + "[" * 33 + "]" * 33)
    files["syn_nest_deep"] = "{" + '"x":[' * 100
    files["syn_unclosed_nested"] = obj('"x": [1, {"a": 2]')
    files["syn_truncated_true"] = '{"ddp": tru}'
    files["syn_backslash_end"] = '{"a\\'
    blobs = {name: text.encode("utf-8") for name, text in files.items()}
    # invalid UTF-8 (bytes, not text)
    blobs["syn_utf8_invalid_byte"] = b'{"a\xff": 1}'
    blobs["syn_utf8_overlong"] = b'{"a\xc0\xaf": 1}'
    blobs["syn_utf8_surrogate"] = b'{"a\xed\xa0\x80": 1}'
    blobs["syn_utf8_too_big"] = b'{"a\xf4\x90\x80\x80": 1}'
    blobs["syn_utf8_truncated"] = b'{"a\xe2\x98": 1}'
    blobs["syn_bom"] = b'\xef\xbb\xbf{"partitions": 2}'
    blobs["syn_nul_inside"] = b'{"partitions": 2\x00}'
    for name, blob in sorted(blobs.items()):
        with open(os.path.join(out, name + ".json"), "wb") as fh:
            fh.write(blob)
    print(f"wrote {len(blobs)} files to {out}")


if __name__ == "__main__":
    main()
