package gormrelay

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/gorm-outbox/outbox/relay"
)

// A park of more than parkLogLimit messages and keys names the first
// parkLogLimit of each and counts the rest.
func TestParkedAttrsBounded(t *testing.T) {
	var parked []relay.Message
	for i := range 30 {
		parked = append(parked, relay.Message{ID: int64(100 + i), MessageID: fmt.Sprintf("m%d", i), Key: fmt.Appendf(nil, "key-%d", i%25)})
	}
	attrs := parkedAttrs(3, parked)
	got := map[string]any{}
	for i := 0; i < len(attrs); i += 2 {
		got[attrs[i].(string)] = attrs[i+1]
	}
	require.Equal(t, 3, got["bucket"])
	require.Equal(t, 30, got["parked"])
	require.Len(t, got["ids"], parkLogLimit)
	require.Equal(t, int64(100), got["ids"].([]int64)[0])
	require.Len(t, got["message_ids"], parkLogLimit)
	require.Equal(t, 10, got["ids_omitted"])
	require.Len(t, got["keys"], parkLogLimit)
	require.Equal(t, 5, got["keys_omitted"], "25 distinct keys")

	attrs = parkedAttrs(0, parked[:2])
	require.Len(t, attrs, 10, "nothing omitted: no count attributes")
	require.Equal(t, []string{"key-0", "key-1"}, attrs[9])
}
