/* JSON Schema (the subset OpenAI's structured outputs accept) to grammar text (engine/grammar.h). */
#ifndef MD_JSON_SCHEMA_H
#define MD_JSON_SCHEMA_H

/*
 * DESIGN
 * response_format asks for JSON: any object (json_object) or one that validates against a
 * schema (json_schema). Both become grammar text here, which the engine compiles and enforces
 * token by token, so the output is valid by construction, not checked afterwards.
 *
 * Each schema node becomes one grammar rule; shared pieces (strings, numbers, any value) are
 * fixed rules every grammar carries. The grammar generates a subset of what the schema
 * accepts, never more: properties in their declared order (required ones always, optional ones
 * maybe), no properties beyond the declared ones, compact JSON with at most one space after
 * ':' and ','. Supported: type (one or a list), properties, required, additionalProperties
 * (false, true, or a schema for maps), items, minItems, maxItems, enum, const, anyOf, $ref to
 * #/$defs/... or #/definitions/... (recursion allowed) or #, minLength, maxLength, pattern (a
 * regular-expression subset: literals, escapes \d \w \s, classes, ., groups, |, * + ? {m,n},
 * ^ and $), format (date, time, date-time, uuid, email, ipv4), minimum / maximum /
 * exclusiveMinimum / exclusiveMaximum with integer values. Annotations (title, description,
 * default, examples, $schema, $id, $comment, deprecated, readOnly, writeOnly, strict) are
 * ignored. Any other keyword is refused with its name and where it is, never silently
 * dropped: a constraint the grammar did not enforce would be a broken promise.
 *
 * Loop thread (cJSON).
 */

#include <cjson/cJSON.h>
#include <stddef.h>

/* Grammar text for any JSON object (response_format json_object). Static string. */
const char *md_json_object_grammar(void);

/* Grammar text whose language validates against schema (an object or a boolean). Returns 0
 * with a malloc'd NUL-terminated *out, -EINVAL with a one-line message in err naming the
 * keyword and its location ("unsupported JSON Schema keyword 'uniqueItems' at
 * $.properties.tags"), or -ENOMEM. */
int md_json_schema_grammar(const cJSON *schema, char **out, char *err, size_t errlen);

/*
 * Several schemas in one grammar (tool calls: one arguments schema per tool). Each add writes
 * the rules of one schema ($refs resolve within it) and names, in rule, the rule that matches
 * it; finish writes "root ::= root_body" (which may use those names), the rules and the fixed
 * rules into a malloc'd *out. add returns like md_json_schema_grammar; finish 0 or -ENOMEM.
 */
struct md_jgrammar; /* opaque */
struct md_jgrammar *md_jgrammar_new(void);
int md_jgrammar_add(struct md_jgrammar *b, const cJSON *schema, char *rule, size_t cap,
		    char *err, size_t errlen);
int md_jgrammar_finish(struct md_jgrammar *b, const char *root_body, char **out);
void md_jgrammar_free(struct md_jgrammar *b);

#endif
