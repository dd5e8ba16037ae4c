/* Names a JSON value's kind for error messages ("expected a list, found a string"): one wording
 * for every file format we read with jansson (safetensors headers, config.json, tokenizer.json). */
#ifndef MF_JSON_KIND_H
#define MF_JSON_KIND_H

#include <jansson.h>

/* "an object", "a list", "a string", "an integer", "a real number", "true", "false", "null",
 * or "nothing (the field is missing)" for NULL. */
static inline const char *mf_json_kind(const json_t *v)
{
    if (!v) return "nothing (the field is missing)";
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "a list";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE: return "true";
    case JSON_FALSE: return "false";
    case JSON_NULL: return "null";
    }
    return "?";
}

#endif
