package outbox

// Operation is the kind of write a publish rule reacts to. Operations
// combine as flags: On(Insert|Update, fn) reacts to both; OnCreate,
// OnUpdate and OnDelete are On with a single operation.
type Operation uint8

const (
	// Insert is a row created by Create, CreateInBatches or the insert
	// half of Save.
	Insert Operation = 1 << iota
	// Update is a row changed by Save, Updates or Update.
	Update
	// Delete is a row removed by Delete.
	Delete
)

// String names the operation as a rule's message might: "insert",
// "update" or "delete"; a combination joins them with "|"
// ("insert|update"), and no operation is "none".
func (o Operation) String() string {
	switch o {
	case Insert:
		return "insert"
	case Update:
		return "update"
	case Delete:
		return "delete"
	}
	s := ""
	for _, op := range []Operation{Insert, Update, Delete} {
		if o&op != 0 {
			if s != "" {
				s += "|"
			}
			s += op.String()
		}
	}
	if s == "" {
		return "none"
	}
	return s
}
