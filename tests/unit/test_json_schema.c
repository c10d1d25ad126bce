/* Unit tests for server/json_schema.c: schemas become grammars that accept JSON the schema
 * validates (in the generated form: declared order, compact) and reject what it does not;
 * unsupported keywords are refused by name. Matching runs through engine/grammar.c over a
 * vocabulary of single bytes. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "engine/grammar.h"
#include "server/json_schema.h"
#include "tests/check.h"

static struct md_gvocab *vocab;

static struct md_grammar *schema_grammar(const char *schema)
{
	cJSON *s = cJSON_Parse(schema);
	REQUIRE(CHECK_MSG(s != NULL, "schema does not parse: %s", schema));
	char err[300], *text = NULL;
	int rc = md_json_schema_grammar(s, &text, err, sizeof(err));
	cJSON_Delete(s);
	CHECK_MSG(rc == 0, "schema %s: %s", schema, err);
	if (rc)
		return NULL;
	struct md_grammar *g = NULL;
	rc = md_grammar_parse(text, strlen(text), &g, err, sizeof(err));
	CHECK_MSG(rc == 0, "grammar of %s does not compile: %s\n%s", schema, err, text);
	free(text);
	return g;
}

static bool accepts(struct md_grammar *g, const char *json)
{
	struct md_gmatch *m;
	REQUIRE(CHECK_EQ_I(md_gmatch_new(&m, g, vocab), 0));
	bool ok = md_gmatch_accept_bytes(m, json, strlen(json)) == 0 && md_gmatch_can_end(m);
	md_gmatch_free(m);
	return ok;
}

struct scase {
	const char *schema;
	const char *good[6];
	const char *bad[6];
};

static const struct scase cases[] = {
	{ "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
	  "\"integer\"}},\"required\":[\"name\",\"age\"],\"additionalProperties\":false}",
	  { "{\"name\":\"Ann\",\"age\":31}", "{ \"name\": \"A\\\"b\", \"age\": -4}",
	    "{\"name\":\"\\u00e9t\u00e9\",\"age\":0}" },
	  { "{\"name\":\"Ann\"}", "{\"age\":31,\"name\":\"Ann\"}", "{\"name\":\"Ann\",\"age\":3.5}",
	    "{\"name\":\"Ann\",\"age\":31,\"x\":1}", "{\"name\":\"Ann\",\"age\":012}" } },
	/* optional properties in order, any subset */
	{ "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"boolean\"},\"b\":{\"type\":\"null\"},"
	  "\"c\":{\"type\":\"number\"}},\"required\":[\"b\"]}",
	  { "{\"b\":null}", "{\"a\":true,\"b\":null}", "{\"b\":null,\"c\":1.5e3}",
	    "{\"a\":false,\"b\":null,\"c\":-0.25}" },
	  { "{}", "{\"a\":true}", "{\"a\":true,,\"b\":null}", "{\"b\":null,}", "{,\"b\":null}" } },
	{ "{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2,\"maxItems\":3}",
	  { "[1,2]", "[1, 2, 3]" },
	  { "[]", "[1]", "[1,2,3,4]", "[1,\"a\"]" } },
	{ "{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",1,null]}}",
	  { "[]", "[\"red\"]", "[\"green\",1,null]" },
	  { "[\"blue\"]", "[2]", "[\"red\",]" } },
	{ "{\"const\":{\"k\":[1,2]}}", { "{\"k\":[1,2]}" }, { "{\"k\":[1,2,3]}", "{}" } },
	{ "{\"anyOf\":[{\"type\":\"string\",\"maxLength\":3},{\"type\":\"integer\",\"minimum\":10,"
	  "\"maximum\":20}]}",
	  { "\"abc\"", "\"\"", "10", "15", "20" },
	  { "\"abcd\"", "9", "21", "100", "-15" } },
	{ "{\"type\":\"integer\",\"minimum\":-15,\"exclusiveMaximum\":7}",
	  { "-15", "-9", "0", "6" }, { "-16", "7", "-0", "60", "-150" } },
	{ "{\"type\":\"integer\",\"minimum\":95,\"maximum\":1234}",
	  { "95", "99", "100", "999", "1000", "1234" }, { "94", "1235", "2000", "9", "0095" } },
	{ "{\"type\":\"number\",\"minimum\":0,\"maximum\":1}",
	  { "0", "1", "0.5", "0.001" }, { "1.5", "-0.5", "2", "1.01" } },
	{ "{\"type\":\"number\",\"exclusiveMinimum\":-2,\"maximum\":0}",
	  { "-1", "0", "-1.5", "-0.25" }, { "-2", "-2.5", "0.5", "1" } },
	{ "{\"type\":\"string\",\"format\":\"date\"}",
	  { "\"2024-02-28\"", "\"1999-12-31\"", "\"2023-04-30\"" },
	  { "\"2024-02-30\"", "\"2024-13-01\"", "\"2023-04-31\"", "\"24-01-01\"" } },
	{ "{\"type\":\"string\",\"format\":\"date-time\"}",
	  { "\"2024-02-28T13:45:00Z\"", "\"2024-02-28T23:59:59.123+02:00\"" },
	  { "\"2024-02-28T24:00:00Z\"", "\"2024-02-28 13:45:00Z\"", "\"2024-02-28T13:45:00\"" } },
	{ "{\"type\":\"string\",\"format\":\"uuid\"}",
	  { "\"123e4567-e89b-12d3-a456-426614174000\"" }, { "\"123e4567e89b12d3a456426614174000\"" } },
	{ "{\"type\":\"string\",\"format\":\"ipv4\"}",
	  { "\"192.168.0.1\"", "\"255.255.255.255\"", "\"0.0.0.0\"" },
	  { "\"256.1.1.1\"", "\"1.2.3\"", "\"01.2.3.4\"" } },
	{ "{\"type\":\"string\",\"format\":\"email\"}",
	  { "\"ann.lee@example.com\"", "\"x@mail.example.org\"" }, { "\"ann\"", "\"@example.com\"" } },
	{ "{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3}$\"}",
	  { "\"AB-123\"" }, { "\"AB-12\"", "\"ab-123\"", "\"xAB-123\"" } },
	{ "{\"type\":\"string\",\"pattern\":\"(cat|dog)s?\"}",
	  { "\"cat\"", "\"my dogs!\"", "\"cats\"" }, { "\"cow\"", "\"\"" } },
	{ "{\"type\":\"string\",\"minLength\":2,\"maxLength\":4}",
	  { "\"ab\"", "\"a\\nbc\"", "\"\u00e9\u00e9\"" }, { "\"a\"", "\"abcde\"" } },
	{ "{\"type\":[\"string\",\"null\"]}", { "\"x\"", "null" }, { "1", "true" } },
	/* recursion through $defs */
	{ "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
	  "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},\"required\":[\"v\","
	  "\"kids\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",
	  { "{\"v\":1,\"kids\":[]}", "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[{\"v\":3,\"kids\":[]}]}]}" },
	  { "{\"v\":1}", "{\"v\":1,\"kids\":[{\"v\":2}]}" } },
	/* a map */
	{ "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}",
	  { "{}", "{\"a\":1,\"b\":2}" }, { "{\"a\":\"x\"}" } },
	/* annotations are ignored; no constraint means any value */
	{ "{\"title\":\"t\",\"description\":\"d\",\"properties\":{\"x\":{}},\"required\":[\"x\"]}",
	  { "{\"x\":[1,{\"y\":null}]}", "{\"x\":\"s\"}" }, { "{}", "[]" } },
};

static void test_cases(void)
{
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct scase *c = &cases[i];
		struct md_grammar *g = schema_grammar(c->schema);
		if (!g)
			continue;
		for (int k = 0; k < 6 && c->good[k]; k++)
			CHECK_MSG(accepts(g, c->good[k]), "schema %s should accept %s", c->schema,
				  c->good[k]);
		for (int k = 0; k < 6 && c->bad[k]; k++)
			CHECK_MSG(!accepts(g, c->bad[k]), "schema %s should reject %s", c->schema,
				  c->bad[k]);
		md_grammar_unref(g);
	}
}

static void expect_refused(const char *schema, const char *want)
{
	cJSON *s = cJSON_Parse(schema);
	REQUIRE(CHECK(s != NULL));
	char err[300] = "", *text = NULL;
	int rc = md_json_schema_grammar(s, &text, err, sizeof(err));
	cJSON_Delete(s);
	CHECK_MSG(rc == -EINVAL && !text && strstr(err, want), "schema %s: rc %d err '%s', want '%s'",
		  schema, rc, err, want);
	free(text);
}

static void test_refused(void)
{
	expect_refused("{\"type\":\"array\",\"uniqueItems\":true}",
		       "unsupported JSON Schema keyword 'uniqueItems' at $");
	expect_refused("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\","
		       "\"contentEncoding\":\"base64\"}}}", "'contentEncoding' at $.properties.a");
	expect_refused("{\"oneOf\":[{\"type\":\"string\"}]}", "'oneOf'");
	expect_refused("{\"allOf\":[{\"type\":\"string\"}]}", "'allOf'");
	expect_refused("{\"type\":\"number\",\"multipleOf\":3}", "'multipleOf'");
	expect_refused("{\"type\":\"object\",\"patternProperties\":{}}", "'patternProperties'");
	expect_refused("{\"type\":\"string\",\"format\":\"hostname\"}", "'format' 'hostname'");
	expect_refused("{\"type\":\"number\",\"minimum\":0.5}", "'minimum'");
	expect_refused("{\"type\":\"string\",\"pattern\":\"(?=a)\"}", "'pattern'");
	expect_refused("{\"type\":\"string\",\"pattern\":\"a\\\\1\"}", "'pattern'");
	expect_refused("{\"$ref\":\"http://x/y\"}", "'$ref'");
	expect_refused("{\"$ref\":\"#/$defs/missing\"}", "does not resolve");
	expect_refused("{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "no integer");
	expect_refused("{\"type\":\"bogus\"}", "unknown JSON Schema type 'bogus'");
	expect_refused("false", "accepts nothing");
	expect_refused("{\"type\":\"string\",\"enum\":[1,2]}", "no 'enum' value");
}

/* json_object: any object, nothing else. */
static void test_object_grammar(void)
{
	const char *t = md_json_object_grammar();
	struct md_grammar *g;
	char err[200];
	REQUIRE(CHECK_EQ_I(md_grammar_parse(t, strlen(t), &g, err, sizeof(err)), 0));
	CHECK(accepts(g, "{}"));
	CHECK(accepts(g, "{\"a\": [1, 2.5, -3e2, true, null, {\"b\": \"\\u0041\"}]}"));
	CHECK(!accepts(g, "[]"));
	CHECK(!accepts(g, "\"s\""));
	CHECK(!accepts(g, "{\"a\":01}"));
	CHECK(!accepts(g, "{\"a\":\"\n\"}"));
	md_grammar_unref(g);
}

int main(void)
{
	static char one[256][1];
	const char *pieces[257];
	size_t lens[257];
	bool eog[257] = { 0 };
	for (int i = 0; i < 256; i++) {
		one[i][0] = (char)i;
		pieces[i] = one[i];
		lens[i] = 1;
	}
	pieces[256] = "";
	lens[256] = 0;
	eog[256] = true;
	REQUIRE(CHECK_EQ_I(md_gvocab_new_pieces(&vocab, pieces, lens, eog, 257), 0));
	test_cases();
	test_refused();
	test_object_grammar();
	md_gvocab_free(vocab);
	return failures ? 1 : 0;
}
