/* path: names and paths as docs/FORMAT.md ("Paths") renders them
 * (core/path.h) — the cut of a name at a character boundary, the escapes of
 * each mode, and the bounds of an elided path at their exact edges. The
 * walker's and the CLI's paths are checked end to end in test_pickler and
 * test_cli; here the renderer is driven directly, with names and step
 * lengths no value makes easily. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <sys/mman.h>
#include <unistd.h>

#include "helpers.h"

#include "../core/path.h"

/* s rendered by fn, NUL-terminated in a static buffer. */
typedef size_t (*name_fn)(const char *s, size_t n, char *out);
static const char *shown(name_fn fn, const char *s, size_t n) {
  static char out[DP__STEP_MAX + 1];
  out[fn(s, n, out)] = '\0';
  return out;
}

static const char *escaped(const char *s, size_t n, dp__esc_t mode) {
  static char out[DP__STEP_MAX + 1];
  dp__sbuf_t b = {out, 0, DP__STEP_MAX, 0};
  dp__sb_escaped(&b, s, n, mode, 0);
  out[b.len] = '\0';
  return out;
}

/* ---- names: cut, then escaped ---- */

/* A 4-byte character that starts 3 bytes before the cut is split by it: the
 * cut moves back over its three continuation bytes to its first byte, and
 * the part shown is still an identifier. */
Test(path, a_cut_through_a_four_byte_character_moves_back_to_its_first_byte) {
  char name[70];
  memset(name, 'a', 61);
  memcpy(name + 61, "\xf0\x9f\x98\x80", 4); /* U+1F600, bytes 61..64 */
  memset(name + 65, 'b', 5);
  cr_assert_eq(dp__name_shown(name, sizeof name, DP_PATH_NAME_MAX), 61);
  char want[80];
  snprintf(want, sizeof want, ".%.61s\u2026", name);
  cr_assert_str_eq(shown(dp__step_name, name, sizeof name), want, "no part of the character is shown");
}

Test(path, a_name_cut_to_64_bytes_ends_with_an_ellipsis_in_each_notation) {
  char name[70], want[80];
  memset(name, 'x', sizeof name);
  snprintf(want, sizeof want, ".%.64s\u2026", name);
  cr_assert_str_eq(shown(dp__step_name, name, sizeof name), want);
  snprintf(want, sizeof want, ".%.64s", name);
  cr_assert_str_eq(shown(dp__step_name, name, 64), want, "64 bytes are shown whole");
  memset(name, '-', sizeof name);
  snprintf(want, sizeof want, "[\"%.64s\u2026\"]", name);
  cr_assert_str_eq(shown(dp__step_name, name, sizeof name), want, "inside quotes, before the closing one");
  snprintf(want, sizeof want, "<reduce %.64s\u2026>", name);
  cr_assert_str_eq(shown(dp__step_reduce, name, sizeof name), want);
}

/* A character whose bytes run past the end of the name is no character:
 * each byte the name holds is \ufffd, and the byte after the name (which
 * would complete it) is never read. */
Test(path, a_character_cut_by_the_end_of_the_name_is_two_replacement_characters) {
  static const char buf[] = "ab\xe2\x80\xa6"; /* "ab…"; the name is its first 4 bytes */
  cr_assert_str_eq(shown(dp__name_bare, buf, 4), "ab\\ufffd\\ufffd");
  cr_assert_str_eq(shown(dp__name_bare, buf, 5), "ab\u2026", "whole, it is shown as it is");
}

/* RFC 3629 ends at U+10FFFF: F4 90 80 80 would be U+110000. */
Test(path, a_code_point_past_u10ffff_is_four_replacement_characters) {
  cr_assert_str_eq(shown(dp__name_bare, "\xf4\x90\x80\x80", 4), "\\ufffd\\ufffd\\ufffd\\ufffd");
  cr_assert_str_eq(shown(dp__name_bare, "\xf4\x8f\xbf\xbf", 4), "\xf4\x8f\xbf\xbf", "U+10FFFF is a character");
}

/* Each lead byte's whole range starts a character: EF (U+F000..U+FFFF, the
 * last three-byte lead) and F0 (U+10000.., the first four-byte lead) as
 * much as those between; an overlong four-byte form (F0 8F BF BF for
 * U+FFFF) is four stray bytes. */
Test(path, characters_of_the_last_three_byte_lead_and_the_first_four_byte_lead_are_shown_as_they_are) {
  cr_assert_str_eq(shown(dp__name_bare, "\xef\xbc\x81|", 4), "\xef\xbc\x81|", "U+FF01, lead EF, is a character");
  cr_assert_str_eq(shown(dp__name_bare, "\xf0\x90\x80\x80", 4), "\xf0\x90\x80\x80",
                   "U+10000, the least of four bytes, is a character");
  cr_assert_str_eq(shown(dp__name_bare, "\xf0\x8f\xbf\xbf", 4), "\\ufffd\\ufffd\\ufffd\\ufffd", "overlong U+FFFF");
}

/* The edges of the escaped ranges: the last C1 control, DEL, the two
 * separators, both ends of the surrogates, and the characters just outside
 * them. */
Test(path, the_edges_of_the_escaped_ranges_are_escaped_and_their_neighbours_shown) {
  cr_assert_str_eq(shown(dp__name_bare, "\xc2\x9f|\xc2\xa0", 5), "\\u009f|\xc2\xa0", "U+009F escaped, U+00A0 shown");
  cr_assert_str_eq(shown(dp__name_bare, "~\x7f", 2), "~\\u007f", "DEL escaped, ~ shown");
  cr_assert_str_eq(shown(dp__name_bare, "\xe2\x80\xa7\xe2\x80\xa8\xe2\x80\xa9", 9), "\xe2\x80\xa7\\u2028\\u2029",
                   "U+2027 shown, the separators escaped");
  cr_assert_str_eq(shown(dp__name_bare, "\xed\xa0\x80|\xed\xbf\xbf", 7), "\\ud800|\\udfff");
  cr_assert_str_eq(shown(dp__name_bare, "\xed\x9f\xbf|\xee\x80\x80", 7), "\xed\x9f\xbf|\xee\x80\x80",
                   "U+D7FF and U+E000 are shown as they are");
}

/* The bidirectional formatting characters are escaped (a right-to-left
 * override in a key made the rest of a path's line display reversed, so a
 * hostile frame's path could read as another), and their neighbours, which
 * reorder nothing, are shown. */
Test(path, bidirectional_formatting_characters_are_escaped_and_their_neighbours_shown) {
  static const char in[] = "\xd8\x9b\xd8\x9c\xd8\x9d|\xe2\x80\x8d\xe2\x80\x8e\xe2\x80\x8f\xe2\x80\x90|"
                           "\xe2\x80\xaa\xe2\x80\xab\xe2\x80\xac\xe2\x80\xad\xe2\x80\xae\xe2\x80\xaf|"
                           "\xe2\x81\xa5\xe2\x81\xa6\xe2\x81\xa7\xe2\x81\xa8\xe2\x81\xa9\xe2\x81\xaa";
  cr_assert_str_eq(escaped(in, sizeof in - 1, DP__ESC_QUOTED),
                   "\xd8\x9b\\u061c\xd8\x9d|\xe2\x80\x8d\\u200e\\u200f\xe2\x80\x90|"
                   "\\u202a\\u202b\\u202c\\u202d\\u202e\xe2\x80\xaf|"
                   "\xe2\x81\xa5\\u2066\\u2067\\u2068\\u2069\xe2\x81\xaa");
  cr_assert_str_eq(shown(dp__name_bare, "a\xe2\x80\xae" "b", 5), "a\\u202eb", "a bare name too");
}

/* Each mode escapes its own delimiter and the backslash, and nothing else
 * of ASCII; text escaped already (a Python repr) keeps its backslashes. */
Test(path, each_mode_escapes_its_delimiter_and_the_backslash_and_controls_mode_neither) {
  static const char s[] = "a'b\"c>d\\e\x01";
  size_t n = sizeof s - 1;
  cr_assert_str_eq(escaped(s, n, DP__ESC_QUOTED), "a'b\\\"c>d\\\\e\\u0001");
  cr_assert_str_eq(escaped(s, n, DP__ESC_SQUOTED), "a\\'b\"c>d\\\\e\\u0001");
  cr_assert_str_eq(escaped(s, n, DP__ESC_BARE), "a'b\"c\\u003ed\\\\e\\u0001");
  cr_assert_str_eq(escaped(s, n, DP__ESC_CONTROLS), "a'b\"c>d\\e\\u0001");
  cr_assert_str_eq(shown(dp__step_reduce, "T>x", 3), "<reduce T\\u003ex>", "a step ends at its first >");
}

/* A text longer than the buffer costs what is kept of it: the scan stops
 * once what it holds pending cannot fit. The text here runs up to a page
 * that cannot be read, far past what the buffer holds.
 * The helper escapes 16 pages of `fill` followed by a page that cannot be
 * read into a 100-byte buffer, with a length past the readable text. */
static void escape_before_unreadable_page(char fill, char out[100], dp__sbuf_t *b) {
  long page = sysconf(_SC_PAGESIZE);
  size_t len = 16 * (size_t)page;
  char *m = mmap(NULL, len + (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  cr_assert_neq(m, MAP_FAILED);
  cr_assert_eq(mprotect(m + len, (size_t)page, PROT_NONE), 0);
  memset(m, fill, len);
  *b = (dp__sbuf_t){out, 0, 100, 0};
  dp__sb_escaped(b, m, SIZE_MAX / 2, DP__ESC_QUOTED, 0);
  munmap(m, len + (size_t)page);
}

Test(path, escaping_a_text_longer_than_the_buffer_reads_no_further_than_it_can_show) {
  char out[100];
  dp__sbuf_t b;
  escape_before_unreadable_page('a', out, &b);
  cr_assert_eq(b.len, sizeof out);
  cr_assert(b.full, "what did not fit is reported");
}

/* The same with a text of characters that are escaped: each escape is a
 * run of its own, so the scan stops because the buffer is full, not because
 * what it holds pending outgrew the room left. */
Test(path, escaping_a_text_of_controls_longer_than_the_buffer_stops_once_it_is_full) {
  char out[100];
  dp__sbuf_t b;
  escape_before_unreadable_page(0x01, out, &b);
  cr_assert_eq(b.len, sizeof out);
  cr_assert(b.full, "what did not fit is reported");
  cr_assert_eq(memcmp(out, "\\u0001\\u0001", 12), 0, "each control shown as \\u0001: %.12s", out);
}

/* ---- whole paths: the edges of DP_PATH_MAX, DP_PATH_HEAD, DP_PATH_TAIL ---- */

/* Step i is lens[i] bytes of one letter, 'A' + i. */
typedef struct steps {
  const size_t *lens;
  int calls;
} steps_t;

static size_t letter_step(void *ctx, size_t i, char *buf) {
  steps_t *s = ctx;
  s->calls++;
  memset(buf, 'A' + (int)i, s->lens[i]);
  return s->lens[i];
}

/* The path expected: "$", steps [0, head), mid (or nothing), steps [tail, n). */
static const char *want_path(const size_t *lens, size_t head, const char *mid, size_t tail, size_t n) {
  static char w[DP_PATH_MAX * 2];
  size_t k = 0;
  w[k++] = '$';
  for (size_t i = 0; i < head; i++) memset(w + k, 'A' + (int)i, lens[i]), k += lens[i];
  k += (size_t)snprintf(w + k, sizeof w - k, "%s", mid);
  for (size_t i = tail; i < n; i++) memset(w + k, 'A' + (int)i, lens[i]), k += lens[i];
  w[k] = '\0';
  return w;
}

static const char *render(const size_t *lens, size_t n) {
  static char out[DP_PATH_MAX + 1];
  steps_t s = {lens, 0};
  size_t len = dp__path_render(out, n, letter_step, &s);
  cr_assert_eq(len, strlen(out));
  cr_assert_leq(len, DP_PATH_MAX);
  return out;
}

Test(path, a_path_of_exactly_dp_path_max_bytes_is_shown_whole) {
  static const size_t lens[3] = {341, 341, 341}; /* 1 + 1023 = 1024 */
  cr_assert_str_eq(render(lens, 3), want_path(lens, 3, "", 3, 3));
  static const size_t over[3] = {341, 341, 342};
  cr_assert_str_eq(render(over, 3), want_path(over, 0, "<\u20261 step\u2026>", 1, 3),
                   "one byte more is elided (no step fits in the head)");
}

/* The head keeps a step that ends exactly at DP_PATH_HEAD bytes; the tail
 * keeps steps that fill DP_PATH_TAIL exactly; the count says "steps". */
Test(path, an_elided_path_keeps_a_head_and_a_tail_that_fill_their_budgets_exactly) {
  static const size_t lens[6] = {DP_PATH_HEAD - 1, 100, 100, 100, DP_PATH_TAIL / 2, DP_PATH_TAIL / 2};
  cr_assert_str_eq(render(lens, 6), want_path(lens, 1, "<\u20263 steps\u2026>", 4, 6));
}

Test(path, one_step_left_out_is_counted_as_one_step) {
  static const size_t lens[4] = {DP_PATH_HEAD - 1, 100, DP_PATH_TAIL / 2, DP_PATH_TAIL / 2};
  cr_assert_str_eq(render(lens, 4), want_path(lens, 1, "<\u20261 step\u2026>", 2, 4));
}

/* ---- found unchecked by a mutation run of path.c ---- */

/* A buffer filled exactly holds everything: `full` says something was
 * dropped, and nothing was. */
Test(path, a_text_that_fills_the_buffer_exactly_is_not_reported_as_cut) {
  char out[4];
  dp__sbuf_t b = {out, 0, sizeof out, 0};
  dp__sb_put(&b, "ab", 2);
  dp__sb_put(&b, "cd", 2);
  cr_assert_eq(b.len, 4);
  cr_assert_not(b.full, "4 bytes fit a buffer of 4");
  dp__sb_put(&b, "e", 1);
  cr_assert_eq(b.len, 4);
  cr_assert(b.full, "a fifth does not");
}

/* A name of exactly DP_PATH_NAME_MAX bytes is shown whole, and the byte
 * after it is never read: here it is the first byte of a page that cannot
 * be read. */
Test(path, a_name_of_exactly_64_bytes_is_shown_whole_without_reading_past_it) {
  long page = sysconf(_SC_PAGESIZE);
  char *m = mmap(NULL, 2 * (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  cr_assert_neq(m, MAP_FAILED);
  cr_assert_eq(mprotect(m + page, (size_t)page, PROT_NONE), 0);
  char *name = m + page - DP_PATH_NAME_MAX;
  memset(name, 'n', DP_PATH_NAME_MAX);
  cr_assert_eq(dp__name_shown(name, DP_PATH_NAME_MAX, DP_PATH_NAME_MAX), DP_PATH_NAME_MAX);
  char want[80];
  snprintf(want, sizeof want, ".%.64s", name);
  cr_assert_str_eq(shown(dp__step_name, name, DP_PATH_NAME_MAX), want, "no ellipsis: nothing is cut");
  munmap(m, 2 * (size_t)page);
}

/* Four or more continuation bytes in a row at the cut belong to no
 * character: the cut stays where it is, and a byte before them that could
 * start one is not taken for their start. */
Test(path, a_cut_through_four_stray_continuation_bytes_stays_where_it_is) {
  char name[70];
  memset(name, 'a', 61);
  memset(name + 61, 0x80, 9); /* bytes 61..69: the cut at 64 has 61..64 around it */
  cr_assert_eq(dp__name_shown(name, sizeof name, DP_PATH_NAME_MAX), 64);
}

/* Stray continuation bytes right after a whole character are no part of
 * it: the cut stays at the limit and the character is shown. Moving back to
 * the last byte that was no continuation byte dropped a character that fit
 * ("aaa…ab" + 80 80 showed 63 bytes). A character the cut does split still
 * moves it back. */
Test(path, a_whole_character_before_stray_continuation_bytes_is_kept_by_the_cut) {
  char name[70];
  memset(name, 'a', sizeof name);
  memset(name + 64, 0x80, 3);
  cr_assert_eq(dp__name_shown(name, sizeof name, DP_PATH_NAME_MAX), 64, "an ASCII byte at 63, strays from 64");
  memcpy(name + 62, "\xc3\xa9", 2); /* é ends at 63 */
  cr_assert_eq(dp__name_shown(name, sizeof name, DP_PATH_NAME_MAX), 64, "a two-byte character ending at 63");
  char want[160];
  snprintf(want, sizeof want, "[\"%.62s\xc3\xa9\xe2\x80\xa6\"]", name);
  cr_assert_str_eq(shown(dp__step_name, name, sizeof name), want);
  memcpy(name + 61, "\xe2\x82\xac", 3); /* € ends at 63 */
  cr_assert_eq(dp__name_shown(name, sizeof name, DP_PATH_NAME_MAX), 64, "a three-byte character ending at 63");
  memcpy(name + 62, "\xe2\x82\xac", 3); /* € across the cut: 62..64 */
  cr_assert_eq(dp__name_shown(name, sizeof name, DP_PATH_NAME_MAX), 62, "a character the cut splits");
  cr_assert_eq(dp__name_shown("a\x80\x80x", 4, 2), 2, "an ASCII byte then strays, limit 2: none stepped over");
  cr_assert_eq(dp__name_shown("\x80\x80\x80x", 4, 2), 2, "strays alone: nothing to move back to");
}

/* With a limit under 4, a cut whose every byte down to the first is a
 * continuation byte shows nothing: the character may start at byte 0. */
Test(path, a_cut_under_four_bytes_through_one_character_shows_nothing_of_it) {
  cr_assert_eq(dp__name_shown("\xf0\x9f\x98\x80x", 5, 3), 0, "U+1F600 cut at 3 bytes");
  cr_assert_eq(dp__name_shown("\xe2\x80\xa6x", 4, 2), 0, "U+2026 cut at 2 bytes");
  cr_assert_eq(dp__name_shown("a\xe2\x80\xa6", 4, 3), 1, "the character after 'a' starts at 1");
}

/* The last two-byte lead (DF) starts a character (U+07FF); a lead byte
 * followed by no continuation byte is no character, and does not swallow
 * what follows; an overlong encoding (E0 9F BF for U+07FF) is three stray
 * bytes. */
Test(path, two_byte_characters_up_to_u07ff_are_shown_and_malformed_leads_are_replaced) {
  cr_assert_str_eq(shown(dp__name_bare, "\xdf\xbf|", 3), "\xdf\xbf|", "U+07FF is a character");
  cr_assert_str_eq(shown(dp__name_bare, "\xc3(", 2), "\\ufffd(", "C3 then '(' is a stray byte, then '('");
  cr_assert_str_eq(shown(dp__name_bare, "\xe0\x9f\xbf", 3), "\\ufffd\\ufffd\\ufffd", "overlong U+07FF");
  cr_assert_str_eq(shown(dp__name_bare, "\xe0\xa0\x80", 3), "\xe0\xa0\x80", "U+0800, the least of three bytes");
}

/* A bare name (a class name in a message) cut to 64 bytes ends with an
 * ellipsis too, and one of 64 bytes does not. */
Test(path, a_bare_name_cut_to_64_bytes_ends_with_an_ellipsis) {
  char name[70], want[80];
  memset(name, 'C', sizeof name);
  snprintf(want, sizeof want, "%.64s\u2026", name);
  cr_assert_str_eq(shown(dp__name_bare, name, sizeof name), want);
  snprintf(want, sizeof want, "%.64s", name);
  cr_assert_str_eq(shown(dp__name_bare, name, 64), want, "64 bytes are shown whole");
}

/* A byte that starts no character (C0, C1: only overlong forms; F5..F7:
 * past U+10FFFF) just before the cut is a stray byte of its own, shown as
 * \ufffd: the continuation bytes after it are no part of it, so the cut
 * stays at the limit rather than moving back over it. */
Test(path, a_byte_that_starts_no_character_before_the_cut_is_kept_as_a_stray_byte) {
  static const unsigned char strays[] = {0xC0, 0xC1, 0xF5, 0xF7};
  for (size_t s = 0; s < sizeof strays; s++) {
    char name[70];
    memset(name, 'a', sizeof name);
    name[63] = (char)strays[s];
    memset(name + 64, 0x80, 3);
    cr_assert_eq(dp__name_shown(name, sizeof name, DP_PATH_NAME_MAX), 64, "a stray %02X at 63", strays[s]);
    char want[160];
    snprintf(want, sizeof want, "%.63s\\ufffd\u2026", name);
    cr_assert_str_eq(shown(dp__name_bare, name, sizeof name), want, "a stray %02X at 63", strays[s]);
  }
}

/* An identifier is a letter or '_' then letters, digits or '_': an empty
 * name or one that starts with a digit is shown quoted, as a dict key. */
Test(path, an_empty_name_or_one_starting_with_a_digit_is_shown_quoted) {
  cr_assert_str_eq(shown(dp__step_name, "", 0), "[\"\"]");
  cr_assert_str_eq(shown(dp__step_name, "1a", 2), "[\"1a\"]");
  cr_assert_str_eq(shown(dp__step_name, "9", 1), "[\"9\"]");
  cr_assert_str_eq(shown(dp__step_name, "a1", 2), ".a1", "a digit after the first byte is part of an identifier");
  cr_assert_str_eq(shown(dp__step_name, "_0", 2), "._0");
}

/* An index is written in decimal, from 0 to SIZE_MAX. */
Test(path, an_index_step_is_its_decimal_number_in_brackets) {
  char out[DP__STEP_BUF];
  out[dp__step_index(0, out)] = '\0';
  cr_assert_str_eq(out, "[0]");
  out[dp__step_index(1234567890, out)] = '\0';
  cr_assert_str_eq(out, "[1234567890]");
  char want[32];
  snprintf(want, sizeof want, "[%zu]", (size_t)SIZE_MAX);
  out[dp__step_index(SIZE_MAX, out)] = '\0';
  cr_assert_str_eq(out, want);
}

/* A quoted name (a dict key in a message) cut to 64 bytes ends with an
 * ellipsis inside its quotes, and one of 64 bytes has none. */
Test(path, a_quoted_name_cut_to_64_bytes_ends_with_an_ellipsis_inside_its_quotes) {
  char name[70], want[80];
  memset(name, 'q', sizeof name);
  snprintf(want, sizeof want, "\"%.64s\u2026\"", name);
  cr_assert_str_eq(shown(dp__name_quoted, name, sizeof name), want);
  snprintf(want, sizeof want, "\"%.64s\"", name);
  cr_assert_str_eq(shown(dp__name_quoted, name, 64), want, "64 bytes are shown whole");
}

/* A step inside a dict entry's key names the entry's index. */
Test(path, a_step_into_a_key_names_the_entrys_index) {
  char out[DP__STEP_BUF];
  out[dp__step_in_key(3, out)] = '\0';
  cr_assert_str_eq(out, "<key 3>");
}

/* What rendering a path costs is counted, a step at a time: a path shown
 * whole renders each of its steps once. */
Test(path, a_path_shown_whole_renders_each_step_once) {
  static const size_t lens[3] = {5, 6, 7};
  dp__path_steps_rendered = 0;
  cr_assert_str_eq(render(lens, 3), want_path(lens, 3, "", 3, 3));
  cr_assert_eq(dp__path_steps_rendered, 3);
}
