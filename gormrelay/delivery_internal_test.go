package gormrelay

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

func TestStoredErrorText(t *testing.T) {
	t.Parallel()
	// A text that fits is kept as it is; the note goes on its own line.
	require.Equal(t, "boom", errorText("boom", ""))
	require.Equal(t, "boom\n"+noteOutcomeUnknown, errorText("boom", noteOutcomeUnknown))
	require.Equal(t, noteOutcomeUnknown, DeliveryNote(errorText("boom", noteOutcomeUnknown)))
	require.Empty(t, DeliveryNote("boom"))

	// A long text is cut at a word boundary, says so, and keeps the note
	// within lastErrorMax.
	long := strings.Repeat("record too large ", 300) // 5,100 bytes
	got := errorText(long, noteOutcomeUnknown)
	require.LessOrEqual(t, len(got), lastErrorMax)
	cut, rest, found := strings.Cut(got, " [... cut, 5100 bytes in all]\n")
	require.True(t, found, got)
	require.Equal(t, noteOutcomeUnknown, rest)
	require.True(t, strings.HasPrefix(long, cut) && long[len(cut)] == ' ', "cut between words: %q", cut[len(cut)-30:])
	require.Greater(t, len(cut), lastErrorMax*2/3)
	require.Equal(t, noteOutcomeUnknown, DeliveryNote(got))

	// A text without spaces is cut on a rune boundary.
	runes := strings.Repeat("é", 1500)
	got = cutText(runes, lastErrorMax)
	require.LessOrEqual(t, len(got), lastErrorMax)
	require.True(t, utf8.ValidString(got))

	// The note of an earlier failure is kept by a text without one.
	old := "first\n" + noteOutcomeUnknown
	require.Equal(t, "second\n"+noteOutcomeUnknown, withNote("second", &old))
	require.Equal(t, "second", withNote("second", nil))

	// The cause: before the sink's text, without the note, on one line.
	require.Equal(t, `record too large: 2 bytes, limit 1 (Producer.MaxMessageBytes); topic t`,
		ErrorCause("record too large: 2 bytes, limit 1 (Producer.MaxMessageBytes);\ttopic t; sink error: kafka: x\n"+noteOutcomeUnknown))
	require.Equal(t, "kafka: x", ErrorCause("kafka: x"))
}
